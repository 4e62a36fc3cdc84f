//! The all-reduce benchmark's loop (`flotilla_group::bench::measure_allreduce`) on a real
//! group: the time of a size is the median over iterations of the slowest rank's time (as
//! the MPI and Gloo scripts it is compared with take theirs), and a wrong sum fails it.

#[allow(dead_code)] // the values and tolerances of the all-reduce tests
mod common;

use std::time::Duration;

use common::world;
use flotilla_group::bench::{BenchOptions, measure_allreduce};
use flotilla_tcp::{CommConfig, ProcessGroup};

fn opts(iters: usize) -> BenchOptions {
    BenchOptions {
        sizes: vec![4096],
        warmup: 0,
        iters,
        ..BenchOptions::default()
    }
}

fn cfg(n: usize) -> CommConfig {
    CommConfig::new(Some(0), n).with_timeout(Duration::from_secs(5))
}

/// In iteration `i` only rank `i % 3` is slow (30 ms), so each rank is slow in at most 2 of 5
/// iterations: a rank's own median is fast, while the slowest rank of every iteration is
/// slow. The reported median must be the latter.
#[test]
fn the_time_of_a_size_is_the_median_of_each_iterations_slowest_rank() {
    const SLOW: Duration = Duration::from_millis(30);
    let rows = common::ok(world(3, false, cfg(3), |c| {
        let mut it = 0;
        measure_allreduce(&c, &opts(5), &mut |buf: &mut Vec<f32>| {
            c.all_reduce_sum(buf)?;
            if it % 3 == c.rank() {
                std::thread::sleep(SLOW);
            }
            it += 1;
            Ok(())
        })
    }));
    for (r, rows) in rows.iter().enumerate() {
        assert_eq!(rows.len(), 1);
        assert!(
            rows[0].median >= SLOW,
            "rank {r} reports {:?}: not the slowest rank's time",
            rows[0].median
        );
    }
}

/// A rank whose result differs from the sum in one element fails, naming it; the others,
/// whose results are right, do not.
#[test]
fn a_wrong_sum_fails_the_benchmark_on_the_rank_that_got_it() {
    let res = world(2, false, cfg(2), |c| {
        let mut it = 0;
        measure_allreduce(&c, &opts(3), &mut |buf: &mut Vec<f32>| {
            c.all_reduce_sum(buf)?;
            it += 1;
            if it == 3 && c.rank() == 1 {
                buf[7] += 1.0;
            }
            Ok(())
        })
    });
    assert!(res[0].is_ok(), "rank 0: {:?}", res[0]);
    let err = res[1]
        .as_ref()
        .expect_err("rank 1's wrong sum passed")
        .to_string();
    assert!(err.contains("element 7"), "{err}");
}
