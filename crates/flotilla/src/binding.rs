//! Binding local ranks to cores (`--bind`), as `mpirun --bind-to core` does.
//!
//! The launcher decides each local rank's cores and passes them in the rank's environment
//! ([`CPUS_ENV`], a list like `0,2`); [`bind_child`] applies that list to the child between
//! fork and exec, so every thread the rank starts inherits it. Rank `r` with `t` threads gets
//! the `t` cores at positions `r t .. r t + t` (modulo their number) of the cores the launcher
//! itself may run on, so ranks sharing a core are spread evenly.
//!
//! `auto` (the default) binds only when this job's local ranks want more threads than the
//! host has cores, and only ranks that all compute (all-reduce peers, pipeline stages: the
//! launcher leaves parameter-server jobs and a program's ranks unbound, since binding by rank
//! order can put the workers on one core and the mostly idle servers on the other). Then the
//! job fills the machine anyway, and a rank that the scheduler
//! moves between cores at every wait loses its cache (4 ranks on 2 cores: one all-reduce of
//! 1 MiB over shared memory takes 169–175 µs bound, 208–260 µs unbound; BENCHMARKS.md §28).
//! With a core per thread the scheduler already keeps ranks apart, and two jobs started
//! side by side on one host would be bound onto the same cores: `auto` leaves them alone,
//! `core` binds anyway, `none` never.

use std::process::Command;

/// The environment variable holding a local rank's cores (a comma-separated list).
pub const CPUS_ENV: &str = "FLOTILLA_CPUS";

/// How `flotilla launch` binds local ranks to cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Bind {
    /// Bind when the local ranks' threads outnumber the cores; else leave it to the kernel.
    #[default]
    Auto,
    /// Bind every local rank to its own cores (shared round-robin when they do not suffice).
    Core,
    /// Never bind.
    None,
}

impl std::fmt::Display for Bind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bind::Auto => "auto",
            Bind::Core => "core",
            Bind::None => "none",
        })
    }
}

/// The cores of each of `n` local ranks of `threads` threads, as [`CPUS_ENV`] lists, chosen
/// among `allowed` (the cores this process may run on); `None` when `bind` says not to bind.
/// `all_compute` says whether every rank computes (all-reduce peers, pipeline stages), not
/// some of them mostly wait (parameter servers, or a program's ranks the launcher cannot
/// see into): `auto` binds only such jobs.
pub fn plan(
    bind: Bind,
    n: usize,
    threads: usize,
    allowed: &[usize],
    all_compute: bool,
) -> Option<Vec<String>> {
    let threads = threads.max(1);
    let bind = match bind {
        Bind::None => false,
        Bind::Core => true,
        Bind::Auto => all_compute && n.saturating_mul(threads) > allowed.len(),
    };
    if !bind || allowed.is_empty() {
        return None;
    }
    let per_rank = threads.min(allowed.len());
    let lists = (0..n)
        .map(|r| {
            let mut cores: Vec<usize> = (0..per_rank)
                .map(|i| allowed[(r * threads + i) % allowed.len()])
                .collect();
            cores.sort_unstable();
            cores.dedup();
            let words: Vec<String> = cores.iter().map(usize::to_string).collect();
            words.join(",")
        })
        .collect();
    Some(lists)
}

/// Rank `rank`'s [`CPUS_ENV`] variable under `plan`'s lists, if it is bound.
pub fn rank_var(lists: Option<&[String]>, rank: usize) -> Option<(String, String)> {
    let list = lists?.get(rank)?;
    Some((CPUS_ENV.to_string(), list.clone()))
}

/// The launcher's line for a bound job: each rank's cores.
pub fn describe(lists: &[String]) -> String {
    let ranks: Vec<String> = lists
        .iter()
        .enumerate()
        .map(|(r, l)| format!("{r}:{l}"))
        .collect();
    format!(
        "local ranks bound to cores (rank:cores) {} (--bind none: unbound)",
        ranks.join(" ")
    )
}

/// The cores this process may run on (its affinity mask), in increasing order; empty when
/// the kernel does not say.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: `cpu_set_t` is plain data; the kernel writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: a valid pointer to a set of `size` bytes, for the calling thread (pid 0).
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE, inside the set.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Binds the child `cmd` starts to the cores its [`CPUS_ENV`] names, if set (done in the
/// child before exec, so the whole process and every thread it starts is bound). A list that
/// does not parse, or names no core, leaves the child unbound.
pub fn bind_child(cmd: &mut Command) {
    let Some(list) = cmd
        .get_envs()
        .find(|(k, _)| *k == CPUS_ENV)
        .and_then(|(_, v)| v.and_then(|v| v.to_str()))
    else {
        return;
    };
    let Some(cores) = parse(list) else { return };
    // SAFETY: plain data, filled below before the fork.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for c in cores {
        // SAFETY: `parse` keeps only cores below CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: the closure runs in the forked child before exec, where only
        // async-signal-safe calls are allowed: it makes one system call (sched_setaffinity)
        // on a set built and copied into it before the fork, and its error is
        // `last_os_error` (an `io::Error` holding the number, no allocation); nothing in it
        // allocates or formats.
        unsafe {
            cmd.pre_exec(move || {
                if libc::sched_setaffinity(0, size, &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

/// The cores of a [`CPUS_ENV`] list, or `None` unless it names at least one and each is a
/// number below `CPU_SETSIZE`.
fn parse(list: &str) -> Option<Vec<usize>> {
    let cores: Option<Vec<usize>> = list
        .split(',')
        .map(|w| w.trim().parse().ok())
        .map(|c: Option<usize>| c.filter(|&c| c < libc::CPU_SETSIZE as usize))
        .collect();
    cores.filter(|c| !c.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_binds_only_computing_ranks_that_outnumber_the_cores() {
        let two = [0, 1];
        assert_eq!(plan(Bind::Auto, 2, 1, &two, true), None);
        assert_eq!(
            plan(Bind::Auto, 4, 1, &two, true),
            Some(vec!["0".into(), "1".into(), "0".into(), "1".into()])
        );
        assert_eq!(plan(Bind::None, 4, 1, &two, true), None);
        assert_eq!(
            plan(Bind::Core, 2, 1, &two, true),
            Some(vec!["0".into(), "1".into()])
        );
        // Ranks that mostly wait (servers, a program's): `auto` leaves them, `core` binds.
        assert_eq!(plan(Bind::Auto, 4, 1, &two, false), None);
        assert_eq!(
            plan(Bind::Core, 3, 1, &two, false),
            Some(vec!["0".into(), "1".into(), "0".into()])
        );
    }

    #[test]
    fn a_rank_of_several_threads_gets_as_many_cores_of_the_allowed_ones() {
        let allowed = [2, 3, 5, 7];
        assert_eq!(
            plan(Bind::Core, 3, 2, &allowed, true),
            Some(vec!["2,3".into(), "5,7".into(), "2,3".into()])
        );
        // More threads than cores: each rank gets them all once.
        assert_eq!(
            plan(Bind::Auto, 1, 8, &[0, 1], true),
            Some(vec!["0,1".into()])
        );
    }

    #[test]
    fn lists_that_name_no_valid_core_do_not_parse() {
        assert_eq!(parse("0,2"), Some(vec![0, 2]));
        assert_eq!(parse(""), None);
        assert_eq!(parse("1,x"), None);
        assert_eq!(parse("99999"), None);
    }
}
