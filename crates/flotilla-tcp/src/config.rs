//! TcpGroup configuration.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use flotilla_group::CommError;
use serde::{Deserialize, Serialize};

use crate::secret::Secret;
use crate::tls::TlsConfig;

/// Default TCP port of the rendezvous master (same as torchrun).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Default of [`CommConfig::small_all_reduce_bytes`]: 256 KiB. Chosen with
/// `FLOTILLA_COMM__SMALL_ALL_REDUCE_KB=0` (ring) against `=4096` (doubling) in
/// `flotilla bench allreduce -n 2,4 --sizes 4K,64K,256K,512K,1M --iters 200` over 127.0.0.1 on
/// 2 shared cores (under load, indicative; median µs of 3 runs, 512 KiB of 2). 2 ranks:
/// 4 KiB 66 ring / 41 doubling, 64 KiB 74 / 65, 256 KiB 124 / 106, 512 KiB mixed, 1 MiB
/// 218 / 324. 4 ranks: 4 KiB 222 / 105, 64 KiB 244 / 159, 256 KiB 381 / 311, 512 KiB
/// 534 / 517, 1 MiB 1084 / 1418. Doubling wins up to 256 KiB; from 1 MiB the ring does.
pub const DEFAULT_SMALL_ALL_REDUCE_BYTES: usize = 256 << 10;

/// Default of [`CommConfig::mid_all_reduce_bytes`]: 16 MiB. Chosen with
/// `FLOTILLA_COMM__SMALL_ALL_REDUCE_KB=0` and `FLOTILLA_COMM__MID_ALL_REDUCE_KB=0`
/// (ring) against `=1048576` (Rabenseifner) in `flotilla bench allreduce -n 4 --sizes
/// 512K,1M,4M,16M,64M --iters 30` over 127.0.0.1 on 2 shared cores, 4 interleaved runs each
/// (under load, indicative; median busbw GB/s): 512 KiB 0.26 ring / 0.35 Rabenseifner,
/// 1 MiB 0.23 / 0.40, 4 MiB 0.16 / 0.28, 16 MiB 0.12 / 0.22, 64 MiB 0.13 / 0.15 (a tie
/// within the spread); CPU time of the whole runs the same (7.3–8.2 s both). On links
/// shaped to 1 Gbit/s (`scripts/bench_shaped_links.sh`) both reach the same 0.87–0.94 of
/// the link rate at 1–64 MiB: they send the same bytes, Rabenseifner in `2 log2 n` steps
/// instead of `2 (n-1)`.
pub const DEFAULT_MID_ALL_REDUCE_BYTES: usize = 16 << 20;

/// Payload compression applied to data frames (`comm.compression`: `none` or `lz4`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// Send payloads as they are (fastest on fast networks).
    #[default]
    None,
    /// LZ4-compress payloads of 4 KiB and more when that makes them smaller.
    Lz4,
}

/// Element format of all-reduce traffic on the wire (`comm.wire_format`: `f32` or `bf16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireFormat {
    /// Full-precision `f32` (bit-exact).
    #[default]
    F32,
    /// `bf16` on the wire (half the bytes), accumulation stays in `f32`. Each hop rounds
    /// partial sums to bf16, so results are approximate (about 3 significant digits).
    Bf16,
}

/// Default of [`CommConfig::shm_chunk_bytes`]: 1 MiB per rank slot.
pub const DEFAULT_SHM_CHUNK_BYTES: usize = 1 << 20;

/// How the `f32` collectives of a group travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Shared memory for every group whose members all share this host (by the host keys
    /// of the rendezvous), TCP for the others, and for a group whose members cannot all
    /// open its segment (warned).
    #[default]
    Auto,
    /// TCP for everything (the ring and recursive doubling, as between hosts).
    Tcp,
    /// Shared memory, required: connecting fails unless every rank shares this host.
    Shm,
}

impl std::str::FromStr for Transport {
    type Err = CommError;

    fn from_str(s: &str) -> Result<Self, CommError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Transport::Auto),
            "tcp" => Ok(Transport::Tcp),
            "shm" => Ok(Transport::Shm),
            other => Err(CommError::Config(format!(
                "transport {other:?}: expected auto, tcp or shm"
            ))),
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
        })
    }
}

/// Whether the `f32` all-reduce of a group spanning several hosts goes in three phases:
/// each host's ranks reduce over their shared segment, each local rank all-reduces its
/// shard over TCP with the same local rank of every other host, then each host gathers
/// the shards over its segment (`crate::hier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hierarchical {
    /// Hierarchical when the group spans several hosts, every host holds the same number
    /// (more than one) of its ranks and the transport is not [`Transport::Tcp`]; flat
    /// otherwise.
    #[default]
    Auto,
    /// Always flat: every rank in one TCP algorithm (doubling, Rabenseifner's or the ring).
    Off,
}

impl std::str::FromStr for Hierarchical {
    type Err = CommError;

    fn from_str(s: &str) -> Result<Self, CommError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Hierarchical::Auto),
            "off" => Ok(Hierarchical::Off),
            other => Err(CommError::Config(format!(
                "hierarchical {other:?}: expected auto or off"
            ))),
        }
    }
}

impl fmt::Display for Hierarchical {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hierarchical::Auto => "auto",
            Hierarchical::Off => "off",
        })
    }
}

/// Configuration of a [`crate::TcpGroup`].
///
/// Build it with [`CommConfig::new`] and the `with_*` methods, or fill the public fields
/// directly. A program started by a launcher gets one from the settings of the environment
/// (`flotilla_train::program`: the same keys, names and units as a config job's).
#[derive(Clone)]
pub struct CommConfig {
    /// This process's rank; `None` lets rank 0 assign one (rank 0 itself must be explicit).
    pub rank: Option<usize>,
    /// Number of processes.
    pub world_size: usize,
    /// Host name or IP of rank 0's rendezvous listener.
    pub master_addr: String,
    /// Port of rank 0's rendezvous listener. 0 on rank 0: a port the system picks, which
    /// rank 0 then says on standard error ([`crate::PORT_ANNOUNCEMENT`]) for its launcher to
    /// give the other ranks.
    pub master_port: u16,
    /// Deadline of every individual wait on a peer (default 60 s).
    pub timeout: Duration,
    /// How long rank 0 waits for all ranks to join, and how long other ranks keep retrying
    /// to reach rank 0 (default 300 s).
    pub join_timeout: Duration,
    /// Hash of the model and training configuration; all ranks must agree.
    pub config_hash: u64,
    /// The cluster secret: every connection (to rank 0 and in the mesh) starts with a mutual
    /// HMAC challenge-response proving that both ends hold it, before any other frame
    /// (`None`: connections are not authenticated by a secret). The secret never goes on the
    /// wire; it does not encrypt the traffic after the handshake ([`CommConfig::tls`] does).
    pub secret: Option<Secret>,
    /// Whether this rank may listen and connect over TCP with neither a secret nor TLS (the
    /// user's explicit opt-out, for a trusted network: any process that reaches the ports can
    /// then join the job). Default `false`: such a rank refuses to start, saying how to make
    /// a secret. The in-memory transport needs neither.
    pub insecure: bool,
    /// Mutual TLS of every connection (to rank 0 and in the mesh), set up right after the
    /// TCP connection and before the secret's handshake and any frame: both ends present a
    /// certificate of the cluster CA (`None`: plain TCP).
    pub tls: Option<TlsConfig>,
    /// Payload compression of data frames.
    pub compression: Compression,
    /// Element format of all-reduce traffic.
    pub wire_format: WireFormat,
    /// Largest accepted frame payload in bytes; larger frames are a [`CommError::FrameTooLarge`].
    pub max_frame_bytes: usize,
    /// The most bytes one peer may have queued at this process in one group: collective
    /// frames that arrived before this rank's collective took them, point-to-point messages
    /// nobody has received yet (each counted with [`flotilla_group::MESSAGE_OVERHEAD`]).
    /// The frame that would pass it fails that group's traffic from the peer with a
    /// [`CommError::Protocol`] naming both; frames of a group this process does not know
    /// (yet) are taken for a few groups at a time, then the peer's connection is refused.
    /// Default 1 GiB ([`flotilla_group::DEFAULT_MAX_QUEUED_BYTES`]); at least twice
    /// `max_frame_bytes`. A broadcast or a message larger than this to a rank that has not
    /// started taking it yet needs it raised.
    pub max_queued_bytes: usize,
    /// Size in bytes of the pipelined chunks of ring collectives.
    pub chunk_bytes: usize,
    /// `f32` all-reduces of at most this many bytes take recursive doubling (`log2 n`
    /// steps, latency-optimal) instead of the ring (`2 (n-1)` steps, bandwidth-optimal);
    /// 0 sends every size through the ring. At most `max_frame_bytes` (one frame per step).
    /// Over shared memory, all-reduces of at most this many bytes (and one slot,
    /// [`CommConfig::shm_chunk_bytes`]) take one step (one barrier; every rank sums the
    /// whole buffer) instead of the chunked reduce-scatter and all-gather (two barriers
    /// and more). Every rank of a job must use the same value.
    pub small_all_reduce_bytes: usize,
    /// `f32` all-reduces larger than [`CommConfig::small_all_reduce_bytes`] and of at most
    /// this many bytes, in a group whose size is a power of two, take Rabenseifner's
    /// algorithm (reduce-scatter by recursive halving, all-gather by recursive doubling:
    /// `2 log2 n` steps, the ring's bytes); larger ones, and other groups, the ring. 0 (or a value at most `small_all_reduce_bytes`): none. Every rank of a job must
    /// use the same value.
    pub mid_all_reduce_bytes: usize,
    /// Local address to bind listeners to. Default: rank 0 binds `master_addr`, other ranks
    /// bind the local address of their connection to rank 0.
    pub bind_host: Option<String>,
    /// Address advertised to peers for the mesh. Default: the bound address.
    pub advertise_host: Option<String>,
    /// Port of this rank's mesh listener (every rank but 0, whose connections are the
    /// rendezvous ones): a fixed port for a firewall that opens only known ports. Default
    /// `None`: any free port.
    pub mesh_port: Option<u16>,
    /// Port advertised to peers for the mesh, when they reach this rank's mesh listener
    /// through a forwarded port (a container's published port, a NAT, a relay) rather than
    /// at the port it is bound to. Default `None`: the bound port.
    pub advertise_port: Option<u16>,
    /// `SO_SNDBUF`/`SO_RCVBUF` for data sockets; `None` keeps the kernel's autotuning.
    pub socket_buffer_bytes: Option<usize>,
    /// Worker threads of the communicator's internal tokio runtime (at least 1). Default 1:
    /// connection readers and collectives then share one thread, which measured fastest.
    pub runtime_threads: usize,
    /// Rejoin: how this process enters the job, and whether it lets replaced ranks in.
    pub rejoin: Rejoin,
    /// How the `f32` collectives of a group travel: over a shared-memory segment when all
    /// its members share a host ([`Transport::Auto`], the default), or always over TCP.
    /// Every rank of a job must use the same value.
    pub transport: Transport,
    /// Whether the `f32` all-reduce of a group spanning several hosts is hierarchical
    /// (shared memory inside each host, TCP between hosts on `1/k` of the bytes with `k`
    /// ranks per host). Every rank of a job must use the same value.
    pub hierarchical: Hierarchical,
    /// Directory of the shared-memory segments (`None`: `/dev/shm` when it has room for the
    /// segment, else the system's temporary directory, a file-backed mapping). A segment's
    /// file is removed as soon as every member has mapped it.
    pub shm_dir: Option<PathBuf>,
    /// Bytes of each rank's slot in a shared-memory segment: an all-reduce goes through it
    /// in chunks of this size (double-buffered). A multiple of 4096, at least 4096.
    pub shm_chunk_bytes: usize,
    /// With [`Rejoin::Join`]: the ranks other than 0 the replacement connects to (its
    /// parameter servers); rank 0 is always reached first.
    pub rejoin_links: Vec<usize>,
}

/// Ranks replaced while a job runs (a worker of an asynchronous parameter server restarted
/// by the launcher). The rejoin protocol is in `src/rendezvous/rejoin.rs`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rejoin {
    /// Neither: the rendezvous port closes once every rank joined (the default).
    #[default]
    Off,
    /// This rank keeps a port open for the whole run (rank 0 its rendezvous port, others
    /// their mesh listener) and lets a rank whose connection was lost back in
    /// (point-to-point traffic only).
    Accept,
    /// This process replaces a lost rank of a running job: it connects to rank 0 and to
    /// [`CommConfig::rejoin_links`], and exchanges only point-to-point messages with them.
    Join,
}

impl fmt::Debug for CommConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommConfig")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("master_addr", &self.master_addr)
            .field("master_port", &self.master_port)
            .field("timeout", &self.timeout)
            .field("join_timeout", &self.join_timeout)
            .field("config_hash", &format_args!("{:#018x}", self.config_hash))
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("insecure", &self.insecure)
            .field("tls", &self.tls)
            .field("compression", &self.compression)
            .field("wire_format", &self.wire_format)
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("max_queued_bytes", &self.max_queued_bytes)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("small_all_reduce_bytes", &self.small_all_reduce_bytes)
            .field("mid_all_reduce_bytes", &self.mid_all_reduce_bytes)
            .field("bind_host", &self.bind_host)
            .field("advertise_host", &self.advertise_host)
            .field("mesh_port", &self.mesh_port)
            .field("advertise_port", &self.advertise_port)
            .field("socket_buffer_bytes", &self.socket_buffer_bytes)
            .field("runtime_threads", &self.runtime_threads)
            .field("rejoin", &self.rejoin)
            .field("transport", &self.transport)
            .field("hierarchical", &self.hierarchical)
            .field("shm_dir", &self.shm_dir)
            .field("shm_chunk_bytes", &self.shm_chunk_bytes)
            .field("rejoin_links", &self.rejoin_links)
            .finish()
    }
}

impl Default for CommConfig {
    fn default() -> Self {
        Self {
            rank: Some(0),
            world_size: 1,
            master_addr: "127.0.0.1".to_string(),
            master_port: DEFAULT_MASTER_PORT,
            timeout: Duration::from_secs(60),
            join_timeout: Duration::from_secs(300),
            config_hash: 0,
            secret: None,
            insecure: false,
            tls: None,
            compression: Compression::None,
            wire_format: WireFormat::F32,
            max_frame_bytes: 64 << 20,
            max_queued_bytes: flotilla_group::DEFAULT_MAX_QUEUED_BYTES,
            chunk_bytes: 512 << 10,
            small_all_reduce_bytes: DEFAULT_SMALL_ALL_REDUCE_BYTES,
            mid_all_reduce_bytes: DEFAULT_MID_ALL_REDUCE_BYTES,
            bind_host: None,
            advertise_host: None,
            mesh_port: None,
            advertise_port: None,
            socket_buffer_bytes: None,
            runtime_threads: 1,
            rejoin: Rejoin::Off,
            rejoin_links: Vec::new(),
            transport: Transport::Auto,
            hierarchical: Hierarchical::Auto,
            shm_dir: None,
            shm_chunk_bytes: DEFAULT_SHM_CHUNK_BYTES,
        }
    }
}

impl CommConfig {
    /// A config for `rank` of `world_size` with all other fields at their defaults.
    pub fn new(rank: Option<usize>, world_size: usize) -> Self {
        Self {
            rank,
            world_size,
            ..Self::default()
        }
    }

    /// Sets how the `f32` collectives travel.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Sets whether the all-reduce of a group spanning several hosts is hierarchical.
    pub fn with_hierarchical(mut self, hierarchical: Hierarchical) -> Self {
        self.hierarchical = hierarchical;
        self
    }

    /// Sets the directory of the shared-memory segments.
    pub fn with_shm_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.shm_dir = dir;
        self
    }

    /// Sets the bytes of each rank's slot in a shared-memory segment.
    pub fn with_shm_chunk_bytes(mut self, bytes: usize) -> Self {
        self.shm_chunk_bytes = bytes;
        self
    }

    /// Sets the per-wait timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the join timeout.
    pub fn with_join_timeout(mut self, join_timeout: Duration) -> Self {
        self.join_timeout = join_timeout;
        self
    }

    /// Sets the master address and port.
    pub fn with_master(mut self, addr: impl Into<String>, port: u16) -> Self {
        self.master_addr = addr.into();
        self.master_port = port;
        self
    }

    /// Sets the config hash.
    pub fn with_config_hash(mut self, hash: u64) -> Self {
        self.config_hash = hash;
        self
    }

    /// Sets the cluster secret.
    pub fn with_secret(mut self, secret: Option<Secret>) -> Self {
        self.secret = secret;
        self
    }

    /// Sets [`CommConfig::insecure`]: with neither a secret nor TLS, run unauthenticated
    /// instead of refusing (a trusted network only).
    pub fn with_insecure(mut self, insecure: bool) -> Self {
        self.insecure = insecure;
        self
    }

    /// Sets (or, with `None`, removes) TLS.
    pub fn with_tls(mut self, tls: Option<TlsConfig>) -> Self {
        self.tls = tls;
        self
    }

    /// Sets payload compression.
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Sets the all-reduce wire format.
    pub fn with_wire_format(mut self, wire_format: WireFormat) -> Self {
        self.wire_format = wire_format;
        self
    }

    /// Sets the maximum frame payload size.
    pub fn with_max_frame_bytes(mut self, max: usize) -> Self {
        self.max_frame_bytes = max;
        self
    }

    /// Sets the most bytes one peer may have queued here in one group (see
    /// [`CommConfig::max_queued_bytes`]).
    pub fn with_max_queued_bytes(mut self, max: usize) -> Self {
        self.max_queued_bytes = max;
        self
    }

    /// Sets the ring chunk size in bytes.
    pub fn with_chunk_bytes(mut self, chunk: usize) -> Self {
        self.chunk_bytes = chunk;
        self
    }

    /// Sets the largest all-reduce (in bytes) that takes recursive doubling (0: none).
    pub fn with_small_all_reduce_bytes(mut self, bytes: usize) -> Self {
        self.small_all_reduce_bytes = bytes;
        self
    }

    /// Sets the largest all-reduce (in bytes) that takes Rabenseifner's algorithm (see
    /// [`CommConfig::mid_all_reduce_bytes`]).
    pub fn with_mid_all_reduce_bytes(mut self, bytes: usize) -> Self {
        self.mid_all_reduce_bytes = bytes;
        self
    }

    /// Binds this rank's mesh listener to `port` (see [`CommConfig::mesh_port`]).
    pub fn with_mesh_port(mut self, port: Option<u16>) -> Self {
        self.mesh_port = port;
        self
    }

    /// Advertises `port` to peers for the mesh (see [`CommConfig::advertise_port`]).
    pub fn with_advertise_port(mut self, port: Option<u16>) -> Self {
        self.advertise_port = port;
        self
    }

    /// Checks the config for internal consistency.
    pub fn validate(&self) -> Result<(), CommError> {
        let bad = |m: String| Err(CommError::Config(m));
        if self.world_size == 0 {
            return bad("world_size must be at least 1".into());
        }
        if let Some(r) = self.rank
            && r >= self.world_size
        {
            return bad(format!(
                "rank {r} is out of range for world size {}",
                self.world_size
            ));
        }
        if self.timeout.is_zero() || self.join_timeout.is_zero() {
            return bad("timeout and join_timeout must be positive".into());
        }
        if self.max_frame_bytes < 4096 || self.max_frame_bytes > u32::MAX as usize {
            return bad(format!(
                "max_frame_bytes {} must be in 4096..=u32::MAX",
                self.max_frame_bytes
            ));
        }
        if self.max_queued_bytes / 2 < self.max_frame_bytes {
            return bad(format!(
                "max_queued_bytes {} must be at least twice max_frame_bytes ({})",
                self.max_queued_bytes, self.max_frame_bytes
            ));
        }
        if self.chunk_bytes < 1024 || self.chunk_bytes > self.max_frame_bytes {
            return bad(format!(
                "chunk_bytes {} must be at least 1024 and at most max_frame_bytes ({})",
                self.chunk_bytes, self.max_frame_bytes
            ));
        }
        if self.small_all_reduce_bytes > self.max_frame_bytes {
            return bad(format!(
                "small_all_reduce_bytes {} must be at most max_frame_bytes ({})",
                self.small_all_reduce_bytes, self.max_frame_bytes
            ));
        }
        if self.shm_chunk_bytes < 4096
            || !self.shm_chunk_bytes.is_multiple_of(4096)
            || self.shm_chunk_bytes > u32::MAX as usize
        {
            return bad(format!(
                "shm_chunk_bytes {} must be a multiple of 4096 in 4096..=u32::MAX",
                self.shm_chunk_bytes
            ));
        }
        if self.runtime_threads == 0 {
            return bad("runtime_threads must be at least 1".into());
        }
        if self.master_addr.trim().is_empty() {
            return bad("master_addr is empty".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_rejects_bad_values() {
        assert!(CommConfig::new(Some(0), 1).validate().is_ok());
        assert!(CommConfig::new(Some(3), 3).validate().is_err());
        assert!(CommConfig::new(None, 0).validate().is_err());
        assert!(
            CommConfig::new(None, 2)
                .with_chunk_bytes(10)
                .validate()
                .is_err()
        );
        assert!(
            CommConfig::new(None, 2)
                .with_max_frame_bytes(1 << 20)
                .with_chunk_bytes(2 << 20)
                .validate()
                .is_err()
        );
        assert!(
            CommConfig::new(None, 2)
                .with_max_frame_bytes(1 << 20)
                .with_small_all_reduce_bytes(2 << 20)
                .validate()
                .is_err()
        );
        assert!(
            CommConfig::new(None, 2)
                .with_max_queued_bytes(64 << 20)
                .validate()
                .is_err()
        );
    }

    #[test]
    fn debug_redacts_the_secret() {
        let secret = Secret::new(b"s3cret-0123456789".to_vec()).expect("secret");
        let cfg = CommConfig::new(Some(0), 2).with_secret(Some(secret));
        assert!(!format!("{cfg:?}").contains("s3cret"));
    }
}
