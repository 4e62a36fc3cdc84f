//! Which named tensor goes from which stage to which: the crossings of a pipeline of user
//! modules, derived from every stage's declared input and output names.
//!
//! A stage's input comes from the nearest earlier stage that gives a tensor of that name, sent
//! straight to it (a skip tensor from stage 0 to stage 2 does not pass through stage 1, as
//! for spec models). Crossings are numbered by consumer, then input order, the same on every
//! rank, so the crossing number in a message's tag names the tensor. Anything that cannot
//! run is refused here, before any tensor exists: an input no earlier stage gives, an output
//! no later stage takes, a last stage that does not give [`LOSS`] (its other outputs,
//! such as a count of correct predictions, go back to the caller of `Pipeline::evaluate`).

use flotilla_comm::pipeline::wire::MAX_CROSSINGS;

use crate::error::{DistError, Result};

/// The name under which the last stage gives its loss (a tensor of one value: the mean loss
/// of the micro-batch's samples).
pub const LOSS: &str = "loss";

/// One stage's declared names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Names {
    pub(crate) inputs: Vec<String>,
    pub(crate) outputs: Vec<String>,
}

/// A tensor sent from one stage to another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Crossing {
    pub(crate) name: String,
    pub(crate) from: usize,
    pub(crate) to: usize,
}

/// The crossings of stages with `names` (one entry per stage, in order).
pub(crate) fn crossings(names: &[Names]) -> Result<Vec<Crossing>> {
    let fail = |m: String| Err(DistError::Pipeline(m));
    let last = names.len().saturating_sub(1);
    for (s, n) in names.iter().enumerate() {
        for (kind, list) in [("input", &n.inputs), ("output", &n.outputs)] {
            if let Some(d) = list
                .iter()
                .enumerate()
                .find(|(i, a)| list[..*i].contains(a))
            {
                return fail(format!("stage {s} declares the {kind} `{}` twice", d.1));
            }
        }
        let gives_loss = n.outputs.iter().any(|o| o == LOSS);
        if s == last && !gives_loss {
            return fail(format!(
                "the last stage ({s}) must give `{LOSS}`, it declares {:?}",
                n.outputs
            ));
        }
        if s < last && (gives_loss || n.outputs.is_empty()) {
            return fail(format!(
                "stage {s} of {} must give tensors to later stages and not `{LOSS}`, it declares {:?}",
                names.len(),
                n.outputs
            ));
        }
    }
    let mut out = Vec::new();
    for (to, n) in names.iter().enumerate().skip(1) {
        for name in &n.inputs {
            let Some(from) = (0..to).rev().find(|&s| names[s].outputs.contains(name)) else {
                return fail(format!(
                    "stage {to} takes `{name}`, which no earlier stage gives"
                ));
            };
            out.push(Crossing {
                name: name.clone(),
                from,
                to,
            });
        }
    }
    for (s, n) in names.iter().enumerate().take(last) {
        for name in &n.outputs {
            if !out.iter().any(|c| c.from == s && &c.name == name) {
                return fail(format!(
                    "stage {s} gives `{name}`, which no later stage takes"
                ));
            }
        }
    }
    if out.len() > MAX_CROSSINGS {
        return fail(format!(
            "{} tensors cross stages; at most {MAX_CROSSINGS} can",
            out.len()
        ));
    }
    Ok(out)
}

/// One stage's names as text (one name a line, inputs then outputs, a blank line between),
/// to gather from every rank. A name may not hold a line break.
pub(crate) fn encode(n: &Names) -> Result<String> {
    let all = n.inputs.iter().chain(&n.outputs);
    if let Some(bad) = all.clone().find(|s| s.contains('\n') || s.is_empty()) {
        return Err(DistError::Pipeline(format!(
            "tensor name {bad:?}: names are non-empty, on one line"
        )));
    }
    Ok(format!(
        "{}\n\n{}",
        n.inputs.join("\n"),
        n.outputs.join("\n")
    ))
}

/// The names of [`encode`]'s text.
pub(crate) fn decode(text: &str) -> Names {
    let (i, o) = text.split_once("\n\n").unwrap_or((text, ""));
    let list = |s: &str| {
        s.lines()
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    };
    Names {
        inputs: list(i),
        outputs: list(o),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(inputs: &[&str], outputs: &[&str]) -> Names {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
        Names {
            inputs: v(inputs),
            outputs: v(outputs),
        }
    }

    fn err(stages: &[Names]) -> String {
        crossings(stages).expect_err("refused").to_string()
    }

    #[test]
    fn a_skip_tensor_goes_straight_to_its_consumer() {
        let stages = [
            names(&["x"], &["h", "skip"]),
            names(&["h"], &["h"]),
            names(&["h", "skip"], &[LOSS]),
        ];
        let c = crossings(&stages).expect("plan");
        let pairs: Vec<(&str, usize, usize)> =
            c.iter().map(|c| (c.name.as_str(), c.from, c.to)).collect();
        assert_eq!(pairs, [("h", 0, 1), ("h", 1, 2), ("skip", 0, 2)]);
        for s in &stages {
            assert_eq!(&decode(&encode(s).expect("encode")), s);
        }
    }

    #[test]
    fn names_that_do_not_meet_are_refused_naming_them() {
        let e = err(&[names(&["x"], &["h"]), names(&["g"], &[LOSS])]);
        assert!(
            e.contains("stage 1 takes `g`, which no earlier stage gives"),
            "{e}"
        );
        let e = err(&[names(&["x"], &["h", "extra"]), names(&["h"], &[LOSS])]);
        assert!(
            e.contains("stage 0 gives `extra`, which no later stage takes"),
            "{e}"
        );
        let e = err(&[names(&["x"], &["h"]), names(&["h"], &["y"])]);
        assert!(e.contains("must give `loss`"), "{e}");
        let e = err(&[names(&["x"], &["h", "h"]), names(&["h"], &[LOSS])]);
        assert!(e.contains("declares the output `h` twice"), "{e}");
        assert!(encode(&names(&["a\nb"], &[])).is_err());
    }
}
