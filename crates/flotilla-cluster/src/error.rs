//! The crate's error type.

use std::io;
use std::path::PathBuf;

use crate::arch::Arch;

/// Convenience alias for results produced by this crate.
pub type Result<T, E = ClusterError> = std::result::Result<T, E>;

/// Everything that can go wrong while validating a topology, reading an inventory or
/// placing roles on hosts. Messages name the offending key, host, file and line, so they
/// can be shown to a user as-is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// A launcher variable (rank, world size, rendezvous) is set but cannot be used.
    #[error("${var}={value:?}: {reason}")]
    LauncherEnv {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A standalone topology document is not valid YAML or has unknown / mistyped keys.
    #[error("{source_name}: invalid topology config: {source}")]
    Yaml {
        /// Where the document came from (a file name, or a label).
        source_name: String,
        /// The parser's error.
        #[source]
        source: serde_norway::Error,
    },

    /// The architecture requires a key that is absent.
    #[error("arch `{arch}` needs `{key}` ({hint})")]
    MissingKey {
        /// The architecture in use.
        arch: Arch,
        /// The missing key.
        key: &'static str,
        /// What the key should look like.
        hint: &'static str,
    },

    /// A key belongs to another parameter-server architecture.
    #[error("`{key}` is not allowed with arch `{arch}`: it belongs to arch `{belongs_to}`")]
    ForeignKey {
        /// The architecture in use.
        arch: Arch,
        /// The key that does not fit.
        key: &'static str,
        /// The architecture the key is meant for.
        belongs_to: Arch,
    },

    /// Parameter-server keys are set while `arch` is `allreduce` (often because `arch` is
    /// missing) or `pipeline`.
    #[error(
        "`{key}` is set but arch is `{arch}`{default_note}: set `arch: {suggested}` to train \
         with parameter servers, or remove `{key}`",
        default_note = if *arch == Arch::Allreduce { " (the default when `arch` is absent)" } else { "" }
    )]
    PsKeyWithAllreduce {
        /// The architecture given (`allreduce` or `pipeline`).
        arch: Arch,
        /// The parameter-server key that is set.
        key: &'static str,
        /// The architecture the key implies.
        suggested: Arch,
    },

    /// `global_server.local_servers` is empty.
    #[error("`global_server.local_servers` must list at least one local server")]
    NoLocalServers,

    /// A `num_workers` key is 0.
    #[error("`{key}` must be at least 1, got 0")]
    ZeroWorkers {
        /// The full key path, e.g. `global_server.local_servers[1].num_workers`.
        key: String,
    },

    /// `servers` is 0.
    #[error("`servers` must be at least 1, got 0")]
    ZeroServers,

    /// `servers` > 1 with a hierarchical topology.
    #[error(
        "`servers: {servers}` is not supported with arch `hierarchical` yet: parameter \
         sharding across servers is only implemented for arch `flat`; remove `servers` \
         or set it to 1"
    )]
    ShardedHierarchical {
        /// The value given.
        servers: usize,
    },

    /// [`crate::Topology::build`] was given an all-reduce spec, whose world size is not part
    /// of the config.
    #[error(
        "arch `allreduce` has no parameter-server topology to build: its world size comes \
         from the launcher (use Topology::allreduce(world_size))"
    )]
    NotParameterServer,

    /// A topology would have more processes than [`crate::topology::MAX_WORLD_SIZE`] (or a
    /// flat one more server-worker links than [`crate::topology::MAX_LINKS`]).
    #[error("{what}: {count} is more than the {max} this build supports")]
    TooLarge {
        /// What is too large (`processes`, `server-worker links`).
        what: &'static str,
        /// How many were asked for (saturated at `usize::MAX`).
        count: usize,
        /// The limit.
        max: usize,
    },

    /// An all-reduce topology was requested with no processes.
    #[error("an all-reduce world needs at least 1 process, got 0")]
    ZeroWorldSize,

    /// A pipeline was requested with no stage or no replica.
    #[error("a pipeline needs at least 1 stage and 1 replica, got {stages} × {replicas}")]
    EmptyPipeline {
        /// Stages asked for.
        stages: usize,
        /// Replicas asked for (`data_parallel`).
        replicas: usize,
    },

    /// The inventory file cannot be read.
    #[error("cannot read inventory {}: {cause}", path.display())]
    Io {
        /// The inventory file.
        path: PathBuf,
        /// The underlying I/O error (in the message, not chained: shown once).
        cause: io::Error,
    },

    /// A line of an inventory is malformed.
    #[error("{source_name}:{line}: {reason}")]
    InventoryLine {
        /// The inventory's name (usually its path).
        source_name: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong, naming the offending text.
        reason: String,
    },

    /// An ini inventory has sections but no `[pool]`.
    #[error(
        "{source_name}: no [pool] section (Flotilla places roles on the hosts of [pool]); \
         sections found: {}",
        sections.join(", ")
    )]
    NoPoolSection {
        /// The inventory's name (usually its path).
        source_name: String,
        /// The section names present, in order of first appearance, bracketed.
        sections: Vec<String>,
    },

    /// The inventory lists fewer hosts than the topology has processes.
    #[error(
        "topology needs {needed} hosts ({composition}) but inventory {source_name} lists {available}"
    )]
    TooFewHosts {
        /// The world size.
        needed: usize,
        /// What the processes are, e.g. `1 global server, 2 local servers, 4 workers`.
        composition: String,
        /// The inventory's name.
        source_name: String,
        /// Hosts in the inventory.
        available: usize,
    },

    /// An inventory variable of a host has a value Flotilla cannot use.
    #[error("host {host}: {var}: {reason}")]
    HostVar {
        /// The host's inventory name.
        host: String,
        /// The variable.
        var: String,
        /// What is wrong with its value.
        reason: String,
    },

    /// A host's address or user begins with `-`: ssh would read it as an option.
    #[error(
        "host `{host}`: its {what} `{word}` begins with `-`, which ssh would read as an option"
    )]
    OptionLikeHost {
        /// The host's inventory name.
        host: String,
        /// `address` or `user`.
        what: &'static str,
        /// The word.
        word: String,
    },

    /// A word cannot be passed through a shell (it contains a NUL byte).
    #[error("`{word}` cannot be passed to a remote shell (NUL byte)")]
    Unquotable {
        /// The word, NUL bytes shown as `\\0`.
        word: String,
    },
}
