//! flotilla-ps: what every parameter server and worker of Flotilla shares, over flat `f32`
//! buffers and any [`ProcessGroup`]: the wire messages ([`PsMessage`], point to point under
//! [`TAG`], each carrying the parameter version it refers to), the checks a push passes before
//! it touches anything ([`admit`]), the sample-weighted mean of a round ([`Accumulator`],
//! summed in child order for sync rounds) and an [`Inbox`] that waits on every child at once.
//!
//! `flotilla-train`'s servers and workers (`strategy/ps/`, for a spec model and a user's burn
//! module alike) are built on it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod aggregate;
pub mod inbox;
pub mod protocol;

pub use aggregate::{Accumulator, Admission, Mean, Refusal, admit, check_samples};
pub use flotilla_group::ProcessGroup;
pub use inbox::{Event, Inbox};
pub use protocol::{PsMessage, TAG, encode_params};
