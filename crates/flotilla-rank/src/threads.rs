//! The thread a rank trains on, made worker 0 of a rayon pool of its own.
//!
//! The kernels and burn's operations split their work over rayon's *current* pool. From a
//! thread outside every pool, each split is handed to the global pool's threads and the
//! caller sleeps until they are done: two context switches per split, even on one thread (a
//! LeNet-5 step made ~25; its 1-rank epoch took 4.68 s against 4.40 s in its own pool,
//! BENCHMARKS.md §51). As a worker of its own pool, the
//! thread runs a split itself (on one thread: inline), with the pool's other workers, if
//! any, stealing parts of it.

use std::cell::OnceCell;

use crate::error::{RankError, Result};

thread_local! {
    /// The pool this thread is worker 0 of, kept for the thread's life: rayon leaves a thread
    /// registered in the pool it joined for good, so dropping the pool would end its other
    /// workers and leave every later split of this thread to run on it alone.
    static OWN_POOL: OnceCell<rayon::ThreadPool> = const { OnceCell::new() };
}

/// Makes the calling thread worker 0 of a pool of its own, of rayon's default size
/// (`RAYON_NUM_THREADS`, which `--threads` sets; else every CPU). Nothing to do on a thread
/// already in a pool (a rayon worker, or one that joined before). No other thread can hand
/// work to that pool: nothing else holds it, and its worker 0 runs only what it splits.
pub(crate) fn join_own_pool() -> Result<()> {
    join_pool_of(0)
}

/// [`join_own_pool`] with `threads` in the pool (0: rayon's default).
fn join_pool_of(threads: usize) -> Result<()> {
    if rayon::current_thread_index().is_some() {
        return Ok(());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .use_current_thread()
        .thread_name(|i| format!("flotilla-step-{i}"))
        .build()
        .map_err(|e| RankError::Threads(e.to_string()))?;
    OWN_POOL.with(|own| {
        // Empty: a thread with a pool of its own has a current thread index.
        let _ = own.set(pool);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    use super::*;

    /// Splits run on the joining thread alone when its pool has one thread, and on it and
    /// the pool's own workers (never the global pool's) otherwise; joining twice changes
    /// nothing.
    #[test]
    fn a_thread_that_joins_runs_its_splits_in_its_own_pool() {
        for threads in [1, 3] {
            std::thread::spawn(move || {
                assert_eq!(rayon::current_thread_index(), None);
                join_pool_of(threads).expect("join");
                join_pool_of(threads + 1).expect("joined before: nothing to do");
                assert_eq!(rayon::current_thread_index(), Some(0));
                assert_eq!(rayon::current_num_threads(), threads);
                let me = std::thread::current().id();
                let ran: Vec<(bool, String)> = (0..64)
                    .into_par_iter()
                    .map(|_| {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                        let t = std::thread::current();
                        (t.id() == me, t.name().unwrap_or("").to_string())
                    })
                    .collect();
                let here = ran.iter().filter(|(m, _)| *m).count();
                assert!(here > 0, "the joining thread worked on its split");
                if threads == 1 {
                    assert_eq!(here, 64, "every item on the joining thread");
                }
                assert!(
                    ran.iter()
                        .all(|(m, name)| *m || name.starts_with("flotilla-step-")),
                    "an item ran outside the thread's pool: {ran:?}"
                );
            })
            .join()
            .expect("the test's thread");
        }
    }
}
