//! The shape of one sample's activation between layers (the batch dimension is implicit).

use std::fmt;

/// The shape of one sample's activation between layers (the batch dimension is implicit; in
/// burn it comes first: `[n, c, h, w]`, `[n, f]`, `[n, t, d]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// An image-like activation `[channels, height, width]`.
    Image {
        /// Channels.
        c: usize,
        /// Height.
        h: usize,
        /// Width.
        w: usize,
    },
    /// A flat feature vector.
    Flat(usize),
    /// A sequence: `t` positions of `d` features each (row-major, position by position).
    Seq {
        /// Positions (the context length).
        t: usize,
        /// Features per position.
        d: usize,
    },
}

impl Shape {
    /// The shape of one sample of `dims`: `[c, h, w]` an image, `[f]` a flat vector (`None`
    /// for anything else or a zero size).
    pub fn of_sample(dims: &[usize]) -> Option<Shape> {
        match *dims {
            [c, h, w] if c > 0 && h > 0 && w > 0 => Some(Shape::Image { c, h, w }),
            [f] if f > 0 => Some(Shape::Flat(f)),
            _ => None,
        }
    }

    /// Number of values per sample (saturating at `usize::MAX`; a checked spec's shapes are
    /// within [`crate::SpecLimits::max_activation_values`]).
    pub fn numel(&self) -> usize {
        match *self {
            Shape::Image { c, h, w } => c.saturating_mul(h).saturating_mul(w),
            Shape::Flat(f) => f,
            Shape::Seq { t, d } => t.saturating_mul(d),
        }
    }

    /// The kind of activation, for messages: `image`, `flat` or `sequence`.
    pub fn kind(&self) -> &'static str {
        match self {
            Shape::Image { .. } => "image",
            Shape::Flat(_) => "flat",
            Shape::Seq { .. } => "sequence",
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Shape::Image { c, h, w } => write!(f, "[{c}, {h}, {w}]"),
            Shape::Flat(n) => write!(f, "[{n}]"),
            Shape::Seq { t, d } => write!(f, "[{t}, {d}]"),
        }
    }
}
