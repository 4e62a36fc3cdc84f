//! The `comm:` section: the process-group backend, rendezvous, deadlines and the wire, and
//! the communicator settings it makes.

use std::path::PathBuf;
use std::time::Duration;

use flotilla_tcp::{CommConfig, Compression, Hierarchical, Secret, Transport, WireFormat};
use serde::{Deserialize, Serialize};

use super::{TlsSetting, TrainConfig};
use crate::error::Result;

/// Which implementation of the process group a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Flotilla's own TCP transport with its rendezvous (any launcher, or none).
    #[default]
    Tcp,
    /// MPI (Open MPI through rsmpi): start the job with `mpirun -np N flotilla train ...`;
    /// rank and world size come from MPI. Needs a binary built with the `mpi` feature.
    Mpi,
    /// NCCL for the `f32` collectives on this rank's GPU, over Flotilla's TCP group (its
    /// rendezvous, control messages and the NCCL unique id). Needs a binary built with the
    /// `nccl` feature, the NVIDIA driver and NCCL; untested on hardware.
    Nccl,
}

/// Rendezvous, deadlines and the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CommSection {
    /// The process-group implementation: `tcp` (default) or `mpi` (under `mpirun`, with a
    /// binary built with `--features mpi`; the rendezvous keys, `compression`,
    /// `wire_format`, `small_all_reduce_kb` and `mid_all_reduce_kb` then do not apply).
    pub backend: Backend,
    /// Rendezvous address of rank 0.
    pub master_addr: String,
    /// Rendezvous port of rank 0.
    pub master_port: u16,
    /// Deadline in seconds of every wait on another rank.
    pub timeout_s: f64,
    /// Deadline in seconds for all ranks to join.
    pub join_timeout_s: f64,
    /// Payload compression on the wire: `none` (default) or `lz4`.
    pub compression: Compression,
    /// All-reduce element format on the wire: `f32` (default, exact) or `bf16` (half the
    /// bytes, approximate sums).
    pub wire_format: WireFormat,
    /// Gradient fusion bucket size in MiB.
    pub bucket_mb: f64,
    /// All-reduces of at most this many KiB take recursive doubling (`log2 n` steps)
    /// instead of the ring (`2 (n-1)` steps); 0: the ring for every size (over TCP). Over
    /// shared memory they take one step (one barrier, each rank sums the whole buffer)
    /// instead of the chunked reduce-scatter and all-gather.
    pub small_all_reduce_kb: usize,
    /// All-reduces above `small_all_reduce_kb` and of at most this many KiB take
    /// Rabenseifner's algorithm (reduce-scatter by recursive halving, all-gather by
    /// recursive doubling: `2 log2 n` steps, the ring's bytes) instead of the ring; 0: none
    /// (TCP backend).
    pub mid_all_reduce_kb: usize,
    /// How the `f32` all-reduces and broadcasts of a group travel (TCP backend): `auto`
    /// (default: a shared-memory segment for every group whose ranks share a host, TCP
    /// between hosts), `tcp` (always TCP) or `shm` (shared memory, required: every rank on
    /// one host). `compression` and `wire_format: bf16` do not apply to shared memory.
    pub transport: Transport,
    /// Whether the all-reduce of ranks on several hosts is hierarchical (TCP backend):
    /// `auto` (default: when every host holds the same number, more than one, of the
    /// group's ranks and `transport` is not `tcp`, each host reduces over shared memory, its
    /// `k` ranks all-reduce one `k`-th each with their peers of the other hosts over TCP,
    /// and each host gathers the parts) or `off` (one flat TCP algorithm over every rank).
    pub hierarchical: Hierarchical,
    /// The pipelined chunks of the TCP ring collectives, in KiB (default 512). Every rank of
    /// a job must use the same value.
    pub chunk_kb: usize,
    /// Each rank's slot of a shared-memory segment in KiB (default 1024; a multiple of 4):
    /// an all-reduce goes through it in chunks of this size.
    pub shm_chunk_kb: usize,
    /// The most MiB one peer may have queued at this rank in one group before its traffic
    /// is refused (default 1024); raise it for a broadcast or message larger than that.
    pub max_queued_mb: usize,
    /// `SO_SNDBUF`/`SO_RCVBUF` of the data sockets in KiB; unset (default): the kernel's
    /// autotuning.
    pub socket_buffer_kb: Option<usize>,
    /// Threads of the TCP transport's own runtime (default 1: connection readers and
    /// collectives share one thread, which measured fastest).
    pub threads: usize,
    /// Directory of the shared-memory segments (per rank; default: `/dev/shm` when it has
    /// room, else the system temporary directory). Each segment's file is removed as soon
    /// as every rank of its group has mapped it.
    pub shm_dir: Option<PathBuf>,
    /// A file holding the cluster secret (mode 0600; not accessible to group or others).
    /// The environment's `FLOTILLA_SECRET` / `FLOTILLA_SECRET_FILE` take precedence. The
    /// secret itself is never a config value or a flag, and never enters the config hash.
    pub secret_file: Option<PathBuf>,
    /// Run without a cluster secret or TLS (TCP backend): the user's explicit opt-out for a
    /// trusted network, where any process that reaches the job's ports can join it; every
    /// rank warns. Default `false`: a rank with neither refuses to start, saying how to make a
    /// secret (`flotilla launch` makes one for every job it starts). The environment's
    /// `FLOTILLA_INSECURE=1` sets it too. Per rank (never hashed).
    #[serde(deserialize_with = "lenient_bool")]
    pub insecure: bool,
    /// Mutual TLS on every connection: `{ca, cert, key}` ([`TlsSetting`]); the environment's
    /// `FLOTILLA_TLS_CA` / `_CERT` / `_KEY` take precedence. Per rank (never hashed).
    pub tls: Option<TlsSetting>,
    /// TLS the launcher sets up itself when `tls` gives none: on every `--inventory` job (its
    /// connections cross a network) `flotilla launch` makes a CA and a certificate per host
    /// for that job alone, copies each host its pair and removes them when the job ends.
    /// Default `true`; `false` (`--no-tls`): plain TCP between the hosts, authenticated by the
    /// secret only (a trusted network). Launcher only (never hashed).
    #[serde(deserialize_with = "lenient_bool")]
    pub auto_tls: bool,
}

impl Default for CommSection {
    fn default() -> Self {
        // The transport's own defaults, in the section's units.
        let d = CommConfig::default();
        Self {
            backend: Backend::Tcp,
            master_addr: "127.0.0.1".into(),
            master_port: flotilla_tcp::DEFAULT_MASTER_PORT,
            timeout_s: 60.0,
            join_timeout_s: 60.0,
            compression: Compression::None,
            wire_format: WireFormat::F32,
            bucket_mb: 25.0,
            small_all_reduce_kb: flotilla_tcp::DEFAULT_SMALL_ALL_REDUCE_BYTES >> 10,
            mid_all_reduce_kb: flotilla_tcp::DEFAULT_MID_ALL_REDUCE_BYTES >> 10,
            transport: Transport::Auto,
            hierarchical: Hierarchical::Auto,
            chunk_kb: d.chunk_bytes >> 10,
            shm_chunk_kb: d.shm_chunk_bytes >> 10,
            max_queued_mb: d.max_queued_bytes >> 20,
            socket_buffer_kb: None,
            threads: d.runtime_threads,
            shm_dir: None,
            secret_file: None,
            insecure: false,
            tls: None,
            auto_tls: true,
        }
    }
}

/// A switch written `true`/`false`, `1`/`0` or `yes`/`no` (as `FLOTILLA_INSECURE=1` reads
/// in the environment, where a number stays a number).
fn lenient_bool<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<bool, D::Error> {
    use serde::de::Error;
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::Bool(b) => Ok(b),
        serde_json::Value::Number(n) if n.as_u64() == Some(1) => Ok(true),
        serde_json::Value::Number(n) if n.as_u64() == Some(0) => Ok(false),
        serde_json::Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" | "1" => Ok(true),
            "false" | "no" | "off" | "0" => Ok(false),
            _ => Err(D::Error::custom(format!("{s:?}: expected true or false"))),
        },
        other => Err(D::Error::custom(format!("{other}: expected true or false"))),
    }
}

impl TrainConfig {
    /// The samples a rank trains on per step (or per push): `batch_size` times
    /// `accumulation_steps` micro-batches.
    pub fn step_batch(&self) -> usize {
        self.data.batch_size * self.allreduce.accumulation_steps.max(1) as usize
    }

    /// Bucket size in bytes.
    pub fn bucket_bytes(&self) -> usize {
        (self.comm.bucket_mb * (1 << 20) as f64) as usize
    }

    /// The job's cluster secret: the environment's (`FLOTILLA_SECRET`, `FLOTILLA_SECRET_FILE`),
    /// else the file of `comm.secret_file`; `None` when neither is set.
    pub fn secret(&self) -> Result<Option<Secret>> {
        if let Some(s) = Secret::from_env()? {
            return Ok(Some(s));
        }
        match &self.comm.secret_file {
            Some(path) => Ok(Some(Secret::from_file(path)?)),
            None => Ok(None),
        }
    }

    /// The communicator settings of `rank` (`None`: let rank 0 assign one), with the job's
    /// secret ([`TrainConfig::secret`]) and this rank's TLS ([`TrainConfig::tls`]).
    pub fn comm_config(
        &self,
        rank: Option<usize>,
        hash: u64,
        world_size: usize,
    ) -> Result<CommConfig> {
        let c = &self.comm;
        Ok(CommConfig {
            rank,
            world_size,
            master_addr: c.master_addr.clone(),
            master_port: c.master_port,
            timeout: Duration::from_secs_f64(c.timeout_s),
            join_timeout: Duration::from_secs_f64(c.join_timeout_s),
            config_hash: hash,
            secret: self.secret()?,
            insecure: c.insecure,
            tls: self.tls()?,
            compression: c.compression,
            wire_format: c.wire_format,
            small_all_reduce_bytes: c.small_all_reduce_kb.saturating_mul(1 << 10),
            mid_all_reduce_bytes: c.mid_all_reduce_kb.saturating_mul(1 << 10),
            chunk_bytes: c.chunk_kb.saturating_mul(1 << 10),
            shm_chunk_bytes: c.shm_chunk_kb.saturating_mul(1 << 10),
            max_queued_bytes: c.max_queued_mb.saturating_mul(1 << 20),
            socket_buffer_bytes: c.socket_buffer_kb.map(|kb| kb.saturating_mul(1 << 10)),
            runtime_threads: c.threads,
            transport: c.transport,
            hierarchical: c.hierarchical,
            shm_dir: c.shm_dir.clone(),
            ..CommConfig::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_is_tcp_by_default_and_mpi_needs_the_feature() {
        assert_eq!(TrainConfig::default().comm.backend, Backend::Tcp);
        let c = TrainConfig::from_yaml("backend: mpi\n", "b.yaml").expect("alias");
        assert_eq!(c.comm.backend, Backend::Mpi);
        let c = TrainConfig::from_yaml("comm: {backend: mpi}\n", "b.yaml").expect("section");
        assert_eq!(c.comm.backend, Backend::Mpi);
        let checked = c.validate();
        if cfg!(feature = "mpi") {
            checked.expect("valid with the feature");
        } else {
            let e = checked.expect_err("needs the feature").to_string();
            assert!(
                e.contains("built without the `mpi` feature") && e.contains("--features mpi"),
                "{e}"
            );
        }
    }

    #[test]
    fn nccl_is_a_backend_that_needs_its_feature() {
        let c = TrainConfig::from_yaml("backend: nccl\n", "b.yaml").expect("alias");
        assert_eq!(c.comm.backend, Backend::Nccl);
        let checked = c.validate();
        if cfg!(feature = "nccl") {
            checked.expect("valid with the feature");
        } else {
            let e = checked.expect_err("needs the feature").to_string();
            assert!(
                e.contains("built without the `nccl` feature") && e.contains("--features nccl"),
                "{e}"
            );
        }
    }

    #[test]
    fn small_all_reduce_kb_reaches_the_communicator_and_is_bounded() {
        let c = TrainConfig::default()
            .comm_config(Some(0), 0, 2)
            .expect("default");
        assert_eq!(
            c.small_all_reduce_bytes,
            flotilla_tcp::DEFAULT_SMALL_ALL_REDUCE_BYTES
        );
        let t = TrainConfig::from_yaml("comm: {small_all_reduce_kb: 4}\n", "s.yaml").expect("key");
        let c = t.comm_config(Some(0), 0, 2).expect("config");
        assert_eq!(c.small_all_reduce_bytes, 4096);
        let t = TrainConfig::from_yaml("small_all_reduce_kb: 0\n", "s.yaml").expect("alias");
        assert_eq!(t.comm.small_all_reduce_kb, 0);
        let t = TrainConfig::from_yaml("small_all_reduce_kb: 1000000\n", "s.yaml").expect("parses");
        let e = t.validate().expect_err("above a frame").to_string();
        assert!(e.contains("comm.small_all_reduce_kb"), "{e}");
    }

    #[test]
    fn mid_all_reduce_kb_reaches_the_communicator() {
        let c = TrainConfig::default()
            .comm_config(Some(0), 0, 4)
            .expect("default");
        assert_eq!(
            c.mid_all_reduce_bytes,
            flotilla_tcp::DEFAULT_MID_ALL_REDUCE_BYTES
        );
        let t = TrainConfig::from_yaml("comm: {mid_all_reduce_kb: 8192}\n", "m.yaml").expect("key");
        let c = t.comm_config(Some(0), 0, 4).expect("config");
        assert_eq!(c.mid_all_reduce_bytes, 8 << 20);
        let t = TrainConfig::from_yaml("mid_all_reduce_kb: 0\n", "m.yaml").expect("alias");
        assert_eq!(
            t.comm_config(Some(0), 0, 4)
                .expect("config")
                .mid_all_reduce_bytes,
            0
        );
    }

    #[test]
    fn transport_and_shm_dir_reach_the_communicator_and_transport_is_hashed() {
        let t = TrainConfig::default();
        assert_eq!(t.comm.transport, Transport::Auto);
        let t = TrainConfig::from_yaml("comm: {transport: tcp, shm_dir: /tmp/x}\n", "t.yaml")
            .expect("keys");
        let c = t.comm_config(Some(0), 0, 2).expect("comm config");
        assert_eq!(c.transport, Transport::Tcp);
        assert_eq!(c.shm_dir.as_deref(), Some(std::path::Path::new("/tmp/x")));
        let t = TrainConfig::from_yaml("transport: shm\n", "t.yaml").expect("alias");
        assert_eq!(t.comm.transport, Transport::Shm);
        let e = TrainConfig::from_yaml("transport: pipe\n", "t.yaml").expect_err("unknown");
        assert!(e.to_string().contains("pipe"), "{e}");
        let a = TrainConfig::default();
        let spec = a.validate().expect("valid");
        let mut b = a.clone();
        b.comm.shm_dir = Some("/elsewhere".into());
        assert_eq!(
            a.cluster_hash(&spec),
            b.cluster_hash(&spec),
            "shm_dir is per rank"
        );
        b.comm.transport = Transport::Tcp;
        assert_ne!(
            a.cluster_hash(&spec),
            b.cluster_hash(&spec),
            "transport is shared"
        );
    }

    #[test]
    fn hierarchical_reaches_the_communicator_and_is_hashed() {
        let t = TrainConfig::default();
        assert_eq!(t.comm.hierarchical, Hierarchical::Auto);
        let c = t.comm_config(Some(0), 0, 4).expect("comm config");
        assert_eq!(c.hierarchical, Hierarchical::Auto);
        let t = TrainConfig::from_yaml("comm: {hierarchical: off}\n", "h.yaml").expect("key");
        let c = t.comm_config(Some(0), 0, 4).expect("comm config");
        assert_eq!(c.hierarchical, Hierarchical::Off);
        let a = TrainConfig::from_yaml("hierarchical: off\n", "h.yaml").expect("alias");
        assert_eq!(a.comm.hierarchical, Hierarchical::Off);
        let e = TrainConfig::from_yaml("hierarchical: maybe\n", "h.yaml").expect_err("unknown");
        assert!(e.to_string().contains("maybe"), "{e}");
        let b = TrainConfig::default();
        let spec = b.validate().expect("valid");
        assert_ne!(
            a.cluster_hash(&spec),
            b.cluster_hash(&spec),
            "hierarchical is shared"
        );
    }
}
