//! The all-reduce benchmark's result check on a real group (in-memory ranks): an
//! all-reduce that sums one rank's chunk at another chunk's offset fails every rank that
//! got the wrong sum, and a bf16 wire's rounded partial sums still check exactly.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use flotilla_group::ProcessGroup;
use flotilla_group::bench::{BenchOptions, measure_allreduce};
use flotilla_tcp::{CommConfig, TcpGroup, Transport, WireFormat};

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
fn world<F>(n: usize, cfg: CommConfig, body: F) -> Vec<Result<(), String>>
where
    F: Fn(&dyn ProcessGroup) -> Result<(), String> + Send + Sync + 'static,
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
