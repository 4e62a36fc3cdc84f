//! What the launcher that started this process says about it: rank, local rank, world
//! size and rendezvous address, from the variables of torchrun, Open MPI, MPICH, Slurm and
//! Kubernetes Indexed Jobs.
//!
//! # Order
//!
//! For each value the first variable that is set (and not blank) wins:
//!
//! | value | variables, in order |
//! |---|---|
//! | rank | `RANK`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `SLURM_PROCID`, `JOB_COMPLETION_INDEX` |
//! | local rank | `LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`, `SLURM_LOCALID` |
//! | world size | `WORLD_SIZE`, `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `SLURM_NTASKS` |
//! | rendezvous host | `MASTER_ADDR`, else the first host of `SLURM_JOB_NODELIST` (or `SLURM_NODELIST`) |
//! | rendezvous port | `MASTER_PORT` |
//!
//! So a torchrun variable beats an MPI one, and an explicit `MASTER_ADDR` beats Slurm's node
//! list. Config files and flags are layered over all of these by the caller.

use crate::error::{ClusterError, Result};

/// Rank variables, in the order they are read.
pub const RANK_VARS: &[&str] = &[
    "RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
    "JOB_COMPLETION_INDEX",
];
/// Local-rank variables (the rank among the processes of one host), in order.
pub const LOCAL_RANK_VARS: &[&str] = &[
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
];
/// World-size variables, in order.
pub const WORLD_SIZE_VARS: &[&str] = &[
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "SLURM_NTASKS",
];
/// Node-list variables whose first host is the rendezvous host when `MASTER_ADDR` is unset.
pub const NODELIST_VARS: &[&str] = &["SLURM_JOB_NODELIST", "SLURM_NODELIST"];

/// A value and the variable it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FromVar<T> {
    /// The value.
    pub value: T,
    /// The variable that set it.
    pub var: &'static str,
}

/// Everything a launcher's environment says; `None` where it says nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LauncherEnv {
    /// This process's rank.
    pub rank: Option<FromVar<usize>>,
    /// Its rank among the processes on its host.
    pub local_rank: Option<FromVar<usize>>,
    /// The number of processes.
    pub world_size: Option<FromVar<usize>>,
    /// The rendezvous host (rank 0's).
    pub master_addr: Option<FromVar<String>>,
    /// The rendezvous port.
    pub master_port: Option<FromVar<u16>>,
}

impl LauncherEnv {
    /// Reads the variables through `get` (e.g. `|k| std::env::var(k).ok()`); a variable that
    /// is set but does not parse is an error naming it.
    pub fn read(get: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let set = |var: &str| get(var).filter(|v| !v.trim().is_empty());
        let first =
            |vars: &'static [&'static str]| vars.iter().find_map(|&var| set(var).map(|v| (var, v)));
        let number = |vars: &'static [&'static str]| -> Result<Option<FromVar<usize>>> {
            first(vars)
                .map(|(var, v)| {
                    v.trim()
                        .parse()
                        .map(|value| FromVar { value, var })
                        .map_err(|_| bad(var, &v, "not a non-negative integer"))
                })
                .transpose()
        };
        let master_addr = match set("MASTER_ADDR") {
            Some(v) => Some(FromVar {
                value: v.trim().to_string(),
                var: "MASTER_ADDR",
            }),
            None => match first(NODELIST_VARS) {
                Some((var, list)) => Some(FromVar {
                    value: first_host(&list).ok_or_else(|| bad(var, &list, "no host in it"))?,
                    var,
                }),
                None => None,
            },
        };
        let master_port = set("MASTER_PORT")
            .map(|v| {
                v.trim()
                    .parse()
                    .map(|value| FromVar {
                        value,
                        var: "MASTER_PORT",
                    })
                    .map_err(|_| bad("MASTER_PORT", &v, "not a port number"))
            })
            .transpose()?;
        Ok(Self {
            rank: number(RANK_VARS)?,
            local_rank: number(LOCAL_RANK_VARS)?,
            world_size: number(WORLD_SIZE_VARS)?,
            master_addr,
            master_port,
        })
    }

    /// Reads this process's environment.
    pub fn from_process() -> Result<Self> {
        Self::read(&|k| std::env::var(k).ok())
    }
}

fn bad(var: &str, value: &str, reason: &str) -> ClusterError {
    ClusterError::LauncherEnv {
        var: var.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

/// The first host of a Slurm host list (`node[01-04,07],gpu1` → `node01`; `a,b` → `a`).
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0usize;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth = depth.saturating_sub(1),
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    // Every bracket gives its first number, which keeps its zero padding (`[01-04]` → `01`).
    let mut host = String::new();
    let mut rest = &list[..end];
    while let Some(open) = rest.find('[') {
        let close = rest[open..].find(']')? + open;
        host.push_str(&rest[..open]);
        host.push_str(rest[open + 1..close].split([',', '-']).next()?.trim());
        rest = &rest[close + 1..];
    }
    host.push_str(rest);
    // What is left of a malformed list (nested or unbalanced brackets) is no host.
    let malformed = |c: char| c.is_whitespace() || matches!(c, '[' | ']' | ',');
    (!host.is_empty() && !host.contains(malformed)).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LauncherEnv> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LauncherEnv::read(&|k| map.get(k).cloned())
    }

    #[test]
    fn slurm_host_lists_give_their_first_host() {
        assert_eq!(first_host("node[01-04,07],gpu1").as_deref(), Some("node01"));
        assert_eq!(first_host("gpu-[3,5-6]-ib").as_deref(), Some("gpu-3-ib"));
        assert_eq!(first_host("login,compute[1-2]").as_deref(), Some("login"));
        assert_eq!(first_host(" single ").as_deref(), Some("single"));
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("[]"), None);
        assert_eq!(
            first_host("rack[1-2]-node[01-04]").as_deref(),
            Some("rack1-node01")
        );
    }

    /// Fuzzing found: a malformed list (nested or unbalanced brackets) gave a "host" with
    /// brackets and commas in it.
    #[test]
    fn malformed_host_lists_give_no_host() {
        assert_eq!(first_host("node[00x=node[00-04,07],gpu1"), None);
        assert_eq!(first_host("a[0[1]]"), None);
        assert_eq!(first_host("a]b,c"), None);
        assert_eq!(first_host("node[01"), None);
    }

    #[test]
    fn the_first_variable_set_wins_in_the_documented_order() {
        let e = env(&[
            ("SLURM_PROCID", "3"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS", "8"),
            ("WORLD_SIZE", "4"),
            ("SLURM_JOB_NODELIST", "node[07-09]"),
        ])
        .expect("valid");
        assert_eq!(
            e.rank,
            Some(FromVar {
                value: 2,
                var: "OMPI_COMM_WORLD_RANK"
            })
        );
        assert_eq!(
            e.local_rank.map(|v| (v.value, v.var)),
            Some((1, "SLURM_LOCALID"))
        );
        assert_eq!(e.world_size.map(|v| v.value), Some(4));
        assert_eq!(
            e.master_addr.map(|v| (v.value, v.var)),
            Some(("node07".to_string(), "SLURM_JOB_NODELIST"))
        );
        // An explicit MASTER_ADDR beats the node list; blank variables count as unset.
        let e = env(&[
            ("MASTER_ADDR", "10.0.0.5"),
            ("SLURM_JOB_NODELIST", "node1"),
            ("RANK", " "),
            ("JOB_COMPLETION_INDEX", "5"),
        ])
        .expect("valid");
        assert_eq!(e.master_addr.map(|v| v.value).as_deref(), Some("10.0.0.5"));
        assert_eq!(
            e.rank.map(|v| (v.value, v.var)),
            Some((5, "JOB_COMPLETION_INDEX"))
        );
        assert_eq!(env(&[]).expect("empty"), LauncherEnv::default());
    }

    #[test]
    fn a_variable_that_does_not_parse_is_named() {
        for (var, value) in [
            ("RANK", "one"),
            ("LOCAL_RANK", "-1"),
            ("MASTER_PORT", "99999"),
            ("SLURM_JOB_NODELIST", "[]"),
        ] {
            let err = env(&[(var, value)]).expect_err(var).to_string();
            assert!(err.contains(var) && err.contains(value), "{err}");
        }
    }
}
