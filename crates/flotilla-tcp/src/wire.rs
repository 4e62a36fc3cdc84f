//! Control messages exchanged on the control channel (JSON payloads).

use flotilla_group::RendezvousError;
use serde::{Deserialize, Serialize};

/// Version of the rendezvous protocol carried in [`Ctrl::Join`].
pub(crate) const RENDEZVOUS_PROTOCOL: u32 = 5;

/// A generation the lighthouse formed, as it tells each member: [`Ctrl::Formed`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Formed {
    pub generation: u64,
    /// The member's rank in it.
    pub rank: usize,
    pub session: u64,
    pub peers: Vec<String>,
    pub hosts: Vec<String>,
    pub slots: Vec<u64>,
    pub step: u64,
}

/// A control-channel message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Ctrl {
    /// Rank r -> rank 0: request to join.
    Join {
        protocol: u32,
        rank: Option<usize>,
        world_size: usize,
        config_hash: u64,
        mesh_addr: String,
        /// The rank's host key (`crate::host::host_key`; empty: unknown).
        host: String,
    },
    /// Rank 0 -> rank r: accepted; `peers[i]` is rank i's mesh address, `hosts[i]` its host
    /// key.
    Welcome {
        rank: usize,
        session: u64,
        peers: Vec<String>,
        hosts: Vec<String>,
    },
    /// Rank 0 -> rank r: the rendezvous failed.
    Reject(RendezvousError),
    /// Mesh handshake, connecting rank -> accepting rank.
    Hello {
        session: u64,
        from: usize,
        to: usize,
    },
    /// Mesh handshake answer.
    HelloAck { from: usize },
    /// Rank r -> rank 0: my mesh connections are up.
    Ready,
    /// Rank r -> rank 0: I could not build my mesh connections.
    MeshFailed { reason: String },
    /// Rank 0 -> rank r: everybody is connected, start.
    Go,
    /// A message of the authentication handshake ([`crate::auth::AuthMsg`], encoded): with a
    /// secret, the first frames of every connection.
    Auth(Vec<u8>),
    /// A replacement of lost rank `rank` -> rank 0, on a running job's rendezvous port:
    /// request to take the lost rank's place (point-to-point traffic only).
    Rejoin {
        protocol: u32,
        rank: usize,
        world_size: usize,
        config_hash: u64,
    },
    /// The accepting rank -> the replacement: the connection is now its link to that rank.
    /// Rank 0 adds the session and the peer table (for the replacement's other links).
    Rejoined { session: u64, peers: Vec<String> },
    /// Any rank -> all: a collective failed here; stop.
    Abort { reason: String },
    /// A rank of an elastic job -> the lighthouse (`crate::rendezvous::lighthouse`): take
    /// me into the next generation. `slot`: the process's name for the launcher (unique per
    /// process of the job); `generation`: the last one it was a member of (0: none, a new
    /// process); `step`: the optimizer steps its training state holds (`None`: it holds
    /// none yet, it takes a member's).
    Enlist {
        protocol: u32,
        slot: u64,
        config_hash: u64,
        mesh_addr: String,
        host: String,
        generation: u64,
        step: Option<u64>,
    },
    /// The lighthouse -> each member of a new generation: its rank, the generation's
    /// session nonce, every member's mesh address, host key and slot (by rank), and the step
    /// the generation resumes at (rank 0's, the most any member holds).
    Formed(Formed),
    /// The lighthouse -> the members of the running generation: the membership changes
    /// (a rank lost, a rank waiting to join); enlist again at the next step boundary.
    Regroup { generation: u64 },
    /// A member -> the lighthouse: its run ended (its last collectives done): the job is
    /// ending, and a member that leaves now is not lost.
    Finished,
    /// The lighthouse -> a process waiting for a generation that it holds a place for
    /// (repeated while it waits): generation `generation` ran without it, as it had no
    /// whole replica to fill (a pipeline's replica takes one process per stage); it stands by
    /// for the next.
    Standby { generation: u64 },
}

impl Ctrl {
    /// Serialises the message.
    pub(crate) fn encode(&self) -> Vec<u8> {
        // Serialising these plain enums to JSON cannot fail; fall back to an empty object.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a message.
    pub(crate) fn decode(b: &[u8]) -> Result<Ctrl, String> {
        serde_json::from_slice(b).map_err(|e| format!("malformed control message: {e}"))
    }
}

/// Fuzzing hook: decodes a control message; when it decodes, encoding it and decoding the
/// encoding must give the same message (compared by their encodings).
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_ctrl(bytes: &[u8]) -> bool {
    let Ok(msg) = Ctrl::decode(bytes) else {
        return false;
    };
    let encoded = msg.encode();
    let again = Ctrl::decode(&encoded).expect("an encoded control message decodes");
    assert_eq!(
        again.encode(),
        encoded,
        "control message does not survive a round trip"
    );
    true
}
