//! Text as a data set of next-token windows: bytes are tokens (a vocabulary of 256), as a
//! byte-level language model reads them.
//!
//! [`TextSplits::load`] reads a file and holds out its last tenth (by default) for
//! validation. A training sample is the window of `context` tokens starting at any offset
//! of the training part, with the next `context` tokens as its targets (windows overlap, as
//! nanoGPT's random offsets do; the [`crate::DistributedSampler`] shuffles and shards the
//! offsets like image indices). Validation uses every non-overlapping window of the held-out
//! part, so evaluation covers it once. Token ids travel as `f32` (exact below 2^24) in the
//! same flat batches as pixels; targets are one `i64` class per position.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{DataError, Result};

/// Tokens in the byte vocabulary.
pub const BYTE_VOCAB: usize = 256;

/// The share of a text's bytes held out for validation (its end).
pub const DEFAULT_VALIDATION_FRACTION: f64 = 0.1;

/// SHA-256 of the vendored `data/text/kjv.txt` (see its README).
pub const KJV_SHA256: &str = "61825e17c79d1135c159801bdacfd9512ec35100c80674266f6c78adf304aabc";

/// The windows of one part of a text.
#[derive(Debug, Clone)]
pub struct TokenWindows {
    /// The part of the text, shared by the windows selected from it.
    tokens: Arc<[u8]>,
    context: usize,
    starts: Vec<usize>,
}

impl TokenWindows {
    /// Every window of `tokens` (overlapping: one per offset) or every non-overlapping one.
    fn new(tokens: Vec<u8>, context: usize, overlapping: bool) -> Self {
        let last = tokens.len().saturating_sub(context + 1);
        let step = if overlapping { 1 } else { context };
        let starts = if tokens.len() > context {
            (0..=last).step_by(step).collect()
        } else {
            Vec::new()
        };
        Self {
            tokens: tokens.into(),
            context,
            starts,
        }
    }

    /// The windows `indices` of this part, in this order, over the same (shared) text.
    ///
    /// # Errors
    /// [`DataError::IndexOutOfRange`] if an index is `>= len()`.
    pub fn select(&self, indices: &[usize]) -> Result<Self> {
        let starts = indices
            .iter()
            .map(|&i| {
                self.starts
                    .get(i)
                    .copied()
                    .ok_or(DataError::IndexOutOfRange {
                        index: i,
                        len: self.len(),
                    })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            tokens: Arc::clone(&self.tokens),
            context: self.context,
            starts,
        })
    }

    /// Number of windows.
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// Whether there are no windows.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// Tokens per window.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Tokens in this part of the text.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Keeps only the first `n` windows (no-op if `n >= len`). Handy for quick runs.
    pub fn truncate(&mut self, n: usize) {
        self.starts.truncate(n);
    }

    /// Window `index`: its `context` input tokens and the `context` tokens that follow each.
    pub fn window(&self, index: usize) -> Option<(&[u8], &[u8])> {
        let s = *self.starts.get(index)?;
        Some((
            &self.tokens[s..s + self.context],
            &self.tokens[s + 1..s + self.context + 1],
        ))
    }

    /// Gathers the windows `indices` into `inputs` (token ids as `f32`, `[n, context]`
    /// row-major) and `targets` (`[n * context]` next-token classes).
    pub fn fill(
        &self,
        indices: &[usize],
        inputs: &mut Vec<f32>,
        targets: &mut Vec<i64>,
    ) -> Result<()> {
        inputs.clear();
        targets.clear();
        for &i in indices {
            let (x, y) = self.window(i).ok_or(DataError::IndexOutOfRange {
                index: i,
                len: self.len(),
            })?;
            inputs.extend(x.iter().map(|&t| f32::from(t)));
            targets.extend(y.iter().map(|&t| i64::from(t)));
        }
        Ok(())
    }
}

/// A text's training and validation windows.
#[derive(Debug, Clone)]
pub struct TextSplits {
    /// Every window of the first part (overlapping).
    pub train: TokenWindows,
    /// Every non-overlapping window of the held-out end.
    pub validation: TokenWindows,
}

impl TextSplits {
    /// Reads `path` and cuts it: the last [`DEFAULT_VALIDATION_FRACTION`] validates.
    pub fn load(path: impl AsRef<Path>, context: usize) -> Result<Self> {
        Self::load_with(path, context, DEFAULT_VALIDATION_FRACTION)
    }

    /// As [`TextSplits::load`], holding out `validation` (in (0, 1)) of the bytes.
    pub fn load_with(path: impl AsRef<Path>, context: usize, validation: f64) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(bytes, context, validation, path)
    }

    /// Cuts `bytes` (read from `path`, named in errors).
    pub fn from_bytes(
        bytes: Vec<u8>,
        context: usize,
        validation: f64,
        path: &Path,
    ) -> Result<Self> {
        let bad = |message: String| DataError::Text {
            path: PathBuf::from(path),
            message,
        };
        if context == 0 {
            return Err(bad("the context must be at least one token".into()));
        }
        if !(validation > 0.0 && validation < 1.0) {
            return Err(bad(format!(
                "the validation fraction {validation} is not in (0, 1)"
            )));
        }
        if bytes.is_empty() {
            return Err(bad("the file is empty".into()));
        }
        // Floor of the training share; every part must hold one window and its targets.
        let cut = ((bytes.len() as f64) * (1.0 - validation)) as usize;
        let need = context + 1;
        if cut < need || bytes.len() - cut < need {
            return Err(bad(format!(
                "{} bytes are too few: its training part ({cut} bytes) and validation part ({} \
                 bytes) must each hold one window of context {context} plus its next token \
                 ({need} bytes)",
                bytes.len(),
                bytes.len() - cut
            )));
        }
        let validation_part = bytes[cut..].to_vec();
        let mut train_part = bytes;
        train_part.truncate(cut);
        Ok(Self {
            train: TokenWindows::new(train_part, context, true),
            validation: TokenWindows::new(validation_part, context, false),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splits(text: &str, context: usize) -> Result<TextSplits> {
        TextSplits::from_bytes(text.as_bytes().to_vec(), context, 0.1, Path::new("t.txt"))
    }

    #[test]
    fn windows_are_inputs_and_the_tokens_that_follow() {
        let text: String = (0..100u8).map(|i| (b'a' + i % 26) as char).collect();
        let s = splits(&text, 4).expect("splits");
        assert_eq!((s.train.tokens(), s.validation.tokens()), (90, 10));
        // Training: every offset with 5 bytes left; validation: non-overlapping.
        assert_eq!(s.train.len(), 86);
        assert_eq!(s.validation.len(), 2);
        let (x, y) = s.train.window(1).expect("window");
        assert_eq!((x, y), (&b"bcde"[..], &b"cdef"[..]));
        let (x, y) = s.validation.window(1).expect("window");
        // The validation part starts at byte 90 ('m'); its second window at 94.
        assert_eq!((x, y), (&b"qrst"[..], &b"rstu"[..]));
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        s.train
            .fill(&[0, 2], &mut inputs, &mut targets)
            .expect("fill");
        assert_eq!(inputs, [97.0, 98.0, 99.0, 100.0, 99.0, 100.0, 101.0, 102.0]);
        assert_eq!(targets, [98, 99, 100, 101, 100, 101, 102, 103]);
        assert!(s.train.fill(&[86], &mut inputs, &mut targets).is_err());
    }

    #[test]
    fn an_empty_or_too_short_text_is_refused_with_its_reason() {
        let e = splits("", 4).expect_err("empty").to_string();
        assert_eq!(e, "t.txt: the file is empty");
        let e = splits(&"x".repeat(40), 4).expect_err("short").to_string();
        assert!(e.contains("40 bytes are too few"), "{e}");
        assert!(e.contains("validation part (4 bytes)"), "{e}");
        assert!(splits(&"x".repeat(50), 4).is_ok());
        assert!(splits("abc", 0).is_err());
    }
}
