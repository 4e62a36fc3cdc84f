//! The deadline ladder of a parameter-server tree, in multiples of `comm.timeout_s`. Each
//! wait is counted from the last message the waiting rank heard, and a rank whose wait
//! runs out names the silent rank and tells its neighbours. So that the rank named is the
//! silent one, the rank nearest it must give up first: each tier waits longer on the tier
//! that itself waits on another (with the same deadline two tiers raced, and whichever
//! heard its last message first blamed the other).
//!
//! - a flat or local server on its workers: the deadline ([`SERVER_ON_WORKERS`]);
//! - the global server on its local servers: 1.1 times ([`GLOBAL_ON_LOCALS`]);
//! - a local server on the global server: 1.25 times ([`LOCAL_ON_GLOBAL`]);
//! - a worker on a flat server: 1.25 times; on a local server: 1.5 times ([`worker_on`]).

use std::time::Duration;

use crate::config::TrainConfig;

/// A flat, shard or local server waiting on its workers.
pub(crate) const SERVER_ON_WORKERS: f64 = 1.0;
/// The global server of a hierarchical job waiting on its local servers.
pub(crate) const GLOBAL_ON_LOCALS: f64 = 1.1;
/// A local server waiting for the global server's answer to its push or pull.
pub(crate) const LOCAL_ON_GLOBAL: f64 = 1.25;

/// `factor` times the job's deadline.
pub(crate) fn of(config: &TrainConfig, factor: f64) -> Duration {
    Duration::from_secs_f64(config.comm.timeout_s).mul_f64(factor)
}

/// How long a worker waits on its server: 1.25 times the deadline, 1.5 under a local
/// server (`under_local`), which itself waits 1.25 times on the global server.
pub(crate) fn worker_on(config: &TrainConfig, under_local: bool) -> Duration {
    of(config, if under_local { 1.5 } else { 1.25 })
}
