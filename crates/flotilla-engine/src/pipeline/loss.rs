//! Cross-entropy on flat logits, outside burn: the loss a pipeline's user computes on the last
//! stage's logits, and evaluation totals from logits that crossed the wire. A row of logits
//! is one label's: a sample's, or a position's of a sequence model (its `n × T × classes`
//! logits are `n × T` rows, against `n × T` labels).

use crate::engine::EvalStats;

/// One row's log-sum-exp and the index of its largest value.
fn log_sum_exp_argmax(row: &[f32]) -> (f64, usize) {
    let (best, max) =
        row.iter().enumerate().fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        );
    let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (max as f64 + sum.ln(), best)
}

/// The mean cross-entropy of `logits` (`labels.len()` rows, row-major) against `labels`, and
/// its gradient with respect to the logits (`(softmax − one_hot) / n`). A label outside the
/// classes gives a NaN loss.
pub fn cross_entropy(logits: &[f32], labels: &[i64]) -> (f32, Vec<f32>) {
    let n = labels.len();
    if n == 0 {
        return (0.0, Vec::new());
    }
    let classes = logits.len() / n;
    let mut grad = vec![0.0f32; logits.len()];
    let mut total = 0.0f64;
    for ((row, g), &label) in logits
        .chunks_exact(classes.max(1))
        .zip(grad.chunks_exact_mut(classes.max(1)))
        .zip(labels)
    {
        let (lse, _) = log_sum_exp_argmax(row);
        let target = usize::try_from(label).unwrap_or(usize::MAX);
        total += lse - row.get(target).map_or(f64::NAN, |&v| v as f64);
        for (k, (gk, &v)) in g.iter_mut().zip(row).enumerate() {
            let p = (v as f64 - lse).exp();
            *gk = ((p - f64::from(u8::from(k == target))) / n as f64) as f32;
        }
    }
    ((total / n as f64) as f32, grad)
}

impl EvalStats {
    /// Loss and accuracy totals of flat logits (`labels.len()` rows) against `labels`.
    pub fn from_logits(logits: &[f32], labels: &[i64]) -> Self {
        let mut stats = EvalStats::default();
        if labels.is_empty() {
            return stats;
        }
        let classes = logits.len() / labels.len();
        for (row, &label) in logits.chunks_exact(classes.max(1)).zip(labels) {
            let (lse, predicted) = log_sum_exp_argmax(row);
            let target = usize::try_from(label).unwrap_or(usize::MAX);
            stats.loss_sum += lse - row.get(target).map_or(f64::NAN, |&v| v as f64);
            stats.correct += usize::from(predicted == target);
            stats.count += 1;
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_entropy_matches_a_hand_computation_and_central_differences() {
        let logits = [1.0f32, 2.0, 0.5, -1.0, 0.0, 3.0];
        let labels = [1i64, 2];
        let (loss, grad) = cross_entropy(&logits, &labels);
        let row = |r: &[f32], t: usize| {
            let lse = r.iter().map(|v| (*v as f64).exp()).sum::<f64>().ln();
            lse - r[t] as f64
        };
        let expected = (row(&logits[..3], 1) + row(&logits[3..], 2)) / 2.0;
        assert!(
            (loss as f64 - expected).abs() < 1e-6,
            "{loss} vs {expected}"
        );
        for i in 0..logits.len() {
            let h = 1e-2f32;
            let mut up = logits;
            up[i] += h;
            let mut down = logits;
            down[i] -= h;
            let numeric =
                (cross_entropy(&up, &labels).0 - cross_entropy(&down, &labels).0) / (2.0 * h);
            assert!(
                (numeric - grad[i]).abs() < 1e-3,
                "d/dx{i}: {numeric} vs {}",
                grad[i]
            );
        }
        let stats = EvalStats::from_logits(&logits, &labels);
        assert_eq!((stats.correct, stats.count), (2, 2));
        assert!((stats.loss() - expected).abs() < 1e-6);
    }
}
