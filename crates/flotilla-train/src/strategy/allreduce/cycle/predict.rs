//! Weight prediction for gradients applied late: the parameters a step's gradient should be
//! computed at when it lands `k` updates later, extrapolated from the last two updates.
//!
//! `ŵ = w_t + k·((1 + β)·Δ_t − β·Δ_{t−1})`, with `Δ_t = w_t − w_{t−1}` and `β` the optimizer's
//! momentum; `β` counts only when both updates are real (not across the start or a drain), and
//! nothing is predicted before the first real update. The async all-reduce of `flotilla train`
//! and of `flotilla-burn` share it, over the flat parameter buffer.

/// The parameters now and before the last two updates, and the prediction made from them.
#[derive(Debug, Clone)]
pub struct WeightHistory {
    current: Vec<f32>,
    previous: Vec<f32>,
    previous2: Vec<f32>,
    predicted: Vec<f32>,
    /// `current − previous` is a real update.
    moved: bool,
    /// `previous − previous2` is one too.
    moved2: bool,
}

impl WeightHistory {
    /// A history of `n` parameters, with no update recorded.
    pub fn new(n: usize) -> Self {
        Self {
            current: vec![0.0; n],
            previous: vec![0.0; n],
            previous2: vec![0.0; n],
            predicted: vec![0.0; n],
            moved: false,
            moved2: false,
        }
    }

    /// Records the parameters that `read` writes into its buffer: after an update (`moved`),
    /// or at the start or after a drain (not: the history restarts from them).
    ///
    /// # Errors
    /// What `read` returns (the history is then not to be used until the next record).
    pub fn record<E>(
        &mut self,
        moved: bool,
        read: impl FnOnce(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        std::mem::swap(&mut self.previous2, &mut self.previous);
        std::mem::swap(&mut self.previous, &mut self.current);
        read(&mut self.current)?;
        if !moved {
            self.previous.copy_from_slice(&self.current);
            self.previous2.copy_from_slice(&self.current);
        }
        self.moved2 = self.moved && moved;
        self.moved = moved;
        Ok(())
    }

    /// The last recorded parameters.
    pub fn current(&self) -> &[f32] {
        &self.current
    }

    /// The parameters predicted `k` updates ahead with momentum `momentum`, or `None` when
    /// there is nothing to predict (`k` is 0, or no real update since the last restart).
    pub fn predict(&mut self, k: usize, momentum: f32) -> Option<&[f32]> {
        if k == 0 || !self.moved {
            return None;
        }
        let k = k as f32;
        // Without two updates in a row, only the last one is known: extrapolate it as it is.
        let b = if self.moved2 { momentum } else { 0.0 };
        for (((p, c), q), q2) in self
            .predicted
            .iter_mut()
            .zip(&self.current)
            .zip(&self.previous)
            .zip(&self.previous2)
        {
            *p = c + k * ((1.0 + b) * (c - q) - b * (q - q2));
        }
        Some(&self.predicted)
    }
}

#[cfg(test)]
mod tests {
    use super::WeightHistory;

    fn record(h: &mut WeightHistory, moved: bool, w: f32) {
        h.record(moved, |b| {
            b.fill(w);
            Ok::<(), ()>(())
        })
        .expect("record");
    }

    #[test]
    fn predicts_from_real_updates_only() {
        let mut h = WeightHistory::new(2);
        record(&mut h, false, 1.0);
        assert!(h.predict(1, 0.9).is_none(), "no update yet");
        record(&mut h, true, 3.0);
        // One real update: Δ = 2, no momentum term: 3 + 2·2.
        assert_eq!(h.predict(2, 0.9), Some(&[7.0, 7.0][..]));
        assert!(h.predict(0, 0.9).is_none());
        record(&mut h, true, 4.0);
        // Δ_t = 1, Δ_{t−1} = 2: 4 + 1·(1.5·1 − 0.5·2) = 4.5.
        assert_eq!(h.predict(1, 0.5), Some(&[4.5, 4.5][..]));
        record(&mut h, false, 10.0);
        assert!(h.predict(1, 0.5).is_none(), "a drain restarts the history");
        assert_eq!(h.current(), &[10.0, 10.0]);
    }
}
