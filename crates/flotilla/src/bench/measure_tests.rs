//! The all-reduce benchmark's loop on a real group (in-memory ranks): the time of a size is
//! the median of each iteration's slowest rank; an all-reduce that sums one rank's chunk at
//! another chunk's offset fails every rank that got the wrong sum, and a bf16 wire's rounded
//! partial sums still check exactly.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use flotilla_tcp::{CommConfig, ProcessGroup, TcpGroup, Transport, WireFormat};

use super::measure::{BenchOptions, measure_allreduce, run_allreduce};

fn opts(bytes: usize, exact_bits: u32) -> BenchOptions {
    BenchOptions {
        sizes: vec![bytes],
        warmup: 0,
        iters: 3,
        exact_bits,
        ..BenchOptions::default()
    }
}

/// Runs `body` on every rank of an in-memory world of `n` (a 10 s deadline); each rank's
/// result, as text.
fn world<T, F>(n: usize, cfg: CommConfig, body: F) -> Vec<Result<T, String>>
where
    T: Send + 'static,
    F: Fn(&dyn ProcessGroup) -> Result<T, String> + Send + Sync + 'static,
{
    let body = Arc::new(body);
    let comms =
        TcpGroup::in_memory(n, cfg.with_timeout(Duration::from_secs(10))).expect("in-memory world");
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let body = body.clone();
            thread::spawn(move || body(&c))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// Rank 1 hands the all-reduce its chunk 1 where chunk 2 belongs (and the other way round),
/// as a ring that misplaces a segment would sum it: every rank's result is wrong there,
/// and every rank's check says so. The same world with the chunks in place passes.
#[test]
fn a_chunk_summed_at_another_offset_fails_the_check_on_every_rank() {
    let (n, elems) = (3, 3000);
    let run = |misplace: bool| {
        world(n, CommConfig::new(Some(0), n), move |c| {
            let reduce = &mut |buf: &mut Vec<f32>| {
                if misplace && c.rank() == 1 {
                    let chunk = buf.len() / 3;
                    let (a, b) = buf.split_at_mut(2 * chunk);
                    a[chunk..].swap_with_slice(&mut b[..chunk]);
                }
                c.all_reduce_sum(buf)
            };
            measure_allreduce(c, &opts(4 * elems, 24), reduce)
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    };
    for (r, res) in run(false).into_iter().enumerate() {
        assert_eq!(res, Ok(()), "rank {r}, chunks in place");
    }
    for (r, res) in run(true).into_iter().enumerate() {
        let err = res.expect_err("a misplaced chunk passed the check");
        assert!(
            err.contains("check failed at element 1000:"),
            "rank {r}: {err}"
        );
    }
}

/// With bf16 on the wire (8 significant bits of every partial sum), the check's values stay
/// exact: the benchmark of `flotilla bench allreduce --bf16` passes on 4 ranks. The f32
/// check's values (up to 2^22 here) do not survive that wire, so the wire does round.
#[test]
fn a_bf16_wire_checks_exactly_with_8_bit_values() {
    let n = 4;
    let run = |bits: u32| {
        // Over the wire's algorithms (the threads of one process would share a segment).
        let mut cfg = CommConfig::new(Some(0), n).with_transport(Transport::Tcp);
        cfg.wire_format = WireFormat::Bf16;
        world(n, cfg, move |c| {
            let reduce = &mut |buf: &mut Vec<f32>| c.all_reduce_sum(buf);
            measure_allreduce(c, &opts(64 << 10, bits), reduce)
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    };
    for (r, res) in run(8).into_iter().enumerate() {
        assert_eq!(res, Ok(()), "rank {r}");
    }
    assert!(
        run(24).iter().any(Result::is_err),
        "f32-sized values passed a bf16 wire"
    );
}

fn iterations(iters: usize) -> BenchOptions {
    BenchOptions {
        sizes: vec![4096],
        warmup: 0,
        iters,
        ..BenchOptions::default()
    }
}

/// In iteration `i` only rank `i % 3` is slow (30 ms), so each rank is slow in at most 2 of
/// 5 iterations: a rank's own median is fast, while the slowest rank of every iteration is
/// slow. The reported median must be the latter.
#[test]
fn the_time_of_a_size_is_the_median_of_each_iterations_slowest_rank() {
    const SLOW: Duration = Duration::from_millis(30);
    let rows = world(3, CommConfig::new(Some(0), 3), |c| {
        let mut it = 0;
        let reduce = &mut |buf: &mut Vec<f32>| {
            c.all_reduce_sum(buf)?;
            if it % 3 == c.rank() {
                thread::sleep(SLOW);
            }
            it += 1;
            Ok(())
        };
        measure_allreduce(c, &iterations(5), reduce).map_err(|e| e.to_string())
    });
    for (r, rows) in rows.into_iter().enumerate() {
        let rows = rows.unwrap_or_else(|e| panic!("rank {r}: {e}"));
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
    let res = world(2, CommConfig::new(Some(0), 2), |c| {
        let mut it = 0;
        let reduce = &mut |buf: &mut Vec<f32>| {
            c.all_reduce_sum(buf)?;
            it += 1;
            if it == 3 && c.rank() == 1 {
                buf[7] += 1.0;
            }
            Ok(())
        };
        measure_allreduce(c, &iterations(3), reduce).map_err(|e| e.to_string())
    });
    assert!(res[0].is_ok(), "rank 0: {:?}", res[0]);
    let err = res[1].as_ref().expect_err("rank 1's wrong sum passed");
    assert!(err.contains("element 7"), "{err}");
}

/// One rank: the group's all-reduce timed, with no bus traffic.
#[test]
fn a_single_rank_runs_and_prints() {
    let rows = world(1, CommConfig::new(Some(0), 1), |c| {
        run_allreduce(c, &iterations(3)).map_err(|e| e.to_string())
    });
    let rows = rows.into_iter().next().expect("rank 0").expect("ran");
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].bytes, rows[0].world_size, rows[0].iters),
        (4096, 1, 3)
    );
    assert_eq!(rows[0].busbw_gbs, 0.0);
}
