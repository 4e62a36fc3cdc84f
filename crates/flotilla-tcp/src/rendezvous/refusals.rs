//! The connections a listener refused, for the error that names them when the ranks it
//! waits for never come: the last [`KEPT`] reasons and how many came before, so that a
//! flood of strangers costs a counter, not memory.

use std::collections::VecDeque;

/// Reasons kept (the newest).
pub(super) const KEPT: usize = 16;

/// The refusals of one listener.
#[derive(Default)]
pub(super) struct Refusals {
    kept: VecDeque<String>,
    earlier: usize,
}

impl Refusals {
    /// Remembers one refusal (forgetting the oldest kept reason past [`KEPT`]).
    pub(super) fn push(&mut self, why: String) {
        if self.kept.len() == KEPT {
            self.kept.pop_front();
            self.earlier += 1;
        }
        self.kept.push_back(why);
    }

    /// The kept reasons (oldest first) and how many refusals came before them.
    pub(super) fn parts(&self) -> (Vec<String>, usize) {
        (self.kept.iter().cloned().collect(), self.earlier)
    }

    /// `; refused meanwhile: N earlier, then a; b` (nothing when none was refused).
    pub(super) fn note(&self) -> String {
        if self.kept.is_empty() {
            return String::new();
        }
        let earlier = if self.earlier > 0 {
            format!("{} earlier, then ", self.earlier)
        } else {
            String::new()
        };
        let kept: Vec<&str> = self.kept.iter().map(String::as_str).collect();
        format!("; refused meanwhile: {earlier}{}", kept.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_reasons_are_kept_and_the_rest_counted() {
        let mut r = Refusals::default();
        assert_eq!(r.note(), "");
        for i in 0..1000 {
            r.push(format!("stranger {i}"));
        }
        let (kept, earlier) = r.parts();
        assert_eq!((kept.len(), earlier), (KEPT, 1000 - KEPT));
        assert_eq!(kept.last().map(String::as_str), Some("stranger 999"));
        assert!(
            r.note()
                .starts_with("; refused meanwhile: 984 earlier, then stranger 984; ")
        );
    }
}
