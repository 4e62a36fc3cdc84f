//! The MPI backend against the process-group contract, under `mpirun --oversubscribe`:
//! each test starts this binary again as the ranks of one scenario (the `rank` entry).
#![cfg(feature = "mpi")]

mod mpirun;

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_group::{CommError, ProcessGroup, ReduceOp};
use flotilla_mpi::{Finalized, MpiConfig, MpiGroup};

use mpirun::{SCENARIO, mpirun};

#[test]
fn collectives_subgroups_and_tagged_messages() {
    let job = mpirun(3, "rank", "contract", Duration::from_secs(120));
    assert!(job.success, "{}", job.output);
    for r in 0..3 {
        assert!(
            job.output.contains(&format!("contract ok rank {r}")),
            "{}",
            job.output
        );
    }
}

#[test]
fn a_late_collective_fails_at_its_deadline_naming_the_others() {
    let job = mpirun(2, "rank", "deadline", Duration::from_secs(60));
    assert!(job.output.contains("deadline ok rank 0"), "{}", job.output);
    // Rank 0's worker is still inside MPI_Barrier when it learns of the failure, so the
    // job ends with MPI_Abort rather than hanging.
    assert!(!job.success, "{}", job.output);
    assert!(job.took < Duration::from_secs(50), "{:?}", job.took);
}

#[test]
fn abort_fails_the_collective_in_progress_at_once() {
    let job = mpirun(2, "rank", "abort", Duration::from_secs(60));
    assert!(job.output.contains("abort ok rank 0"), "{}", job.output);
    assert!(!job.success, "{}", job.output);
}

/// One rank of the scenario named by the environment (only under `mpirun`).
#[test]
#[ignore = "started by the other tests under mpirun"]
fn rank() {
    let scenario = std::env::var(SCENARIO).expect("started by mpirun with a scenario");
    let cfg = MpiConfig {
        timeout: Duration::from_secs(if scenario == "contract" { 60 } else { 1 }),
        config_hash: Some(0xF107),
    };
    let world = MpiGroup::world(cfg).expect("MPI world group");
    let world: Arc<dyn ProcessGroup> = Arc::new(world);
    let clean = match scenario.as_str() {
        "contract" => contract(&*world),
        "deadline" => deadline(&*world),
        "abort" => abort(&world),
        other => panic!("unknown scenario {other}"),
    };
    // Every group is gone before MPI ends.
    drop(world);
    assert_eq!(flotilla_mpi::finalize(clean), Finalized::Clean);
}

fn contract(world: &dyn ProcessGroup) -> bool {
    let (me, n) = (world.rank(), world.size());
    assert_eq!(n, 3);
    reductions(world);
    broadcasts_and_gathers(world);
    subgroups(world);
    tagged_messages(world);
    let stats = world.stats();
    assert!(
        stats.bytes_sent > 0 && stats.bytes_received > 0 && stats.collectives > 10,
        "{stats:?}"
    );
    assert!(world.activity().issued > 10);
    assert_eq!(world.activity().oldest_open, None);
    println!("contract ok rank {me}");
    true
}

fn reductions(world: &dyn ProcessGroup) {
    let (me, n) = (world.rank(), world.size());
    // Integers as floats: the sum is exact, so it must equal the serial sum.
    let mine: Vec<f32> = (0..1000).map(|i| ((me + 1) * i) as f32).collect();
    let mut buf = mine.clone();
    world.all_reduce_sum(&mut buf).expect("all_reduce_sum");
    let serial: Vec<f32> = (0..1000)
        .map(|i| (0..n).map(|r| ((r + 1) * i) as f32).sum())
        .collect();
    assert_eq!(buf, serial);
    // Inexact sums: bit-identical on every rank.
    let mut odd: Vec<f32> = (0..4096)
        .map(|i| 0.1 * (i as f32 + 1.0).ln() * (me as f32 + 0.3))
        .collect();
    // A non-blocking all-reduce takes its place in the order when started.
    let pending = world.all_reduce_start(mine.clone());
    world.all_reduce_sum(&mut odd).expect("second all-reduce");
    assert_eq!(pending.wait().expect("started first"), serial);
    let bits: u64 = odd.iter().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3)
    });
    let all = world.all_gather_u64(bits).expect("hashes");
    assert!(all.iter().all(|&h| h == bits), "{all:x?}");
    let mut ints = vec![i64::MAX, -(me as i64), me as i64];
    world
        .all_reduce_i64(&mut ints, ReduceOp::Sum)
        .expect("i64 sum");
    assert_eq!(
        ints,
        vec![
            i64::MAX.wrapping_add(i64::MAX).wrapping_add(i64::MAX),
            -3,
            3
        ]
    );
    let mut ints = vec![-(me as i64), me as i64];
    world
        .all_reduce_i64(&mut ints, ReduceOp::Min)
        .expect("i64 min");
    assert_eq!(ints, vec![-2, 0]);
    let mut bits = vec![0b111 ^ (1 << me) as u64, 0b1000 | 1 << me];
    world.all_reduce_u64(&mut bits, ReduceOp::And).expect("and");
    assert_eq!(bits, vec![0, 0b1000]);
    let mut bits = vec![1u64 << me];
    world.all_reduce_u64(&mut bits, ReduceOp::Or).expect("or");
    assert_eq!(bits, vec![0b111]);
    world.barrier().expect("barrier");
}

fn broadcasts_and_gathers(world: &dyn ProcessGroup) {
    let me = world.rank();
    let mut f = vec![me as f32; 5];
    world.broadcast_f32(&mut f, 2).expect("broadcast_f32");
    assert_eq!(f, vec![2.0; 5]);
    let mut b = vec![7u8; me * 3];
    world
        .broadcast_bytes(&mut b, 1, 3)
        .expect("broadcast_bytes");
    assert_eq!(b, vec![7u8; 3]);
    let all = world
        .all_gather_bytes(&vec![me as u8; me])
        .expect("all_gather");
    assert_eq!(all, vec![vec![], vec![1], vec![2, 2]]);
    // Empty buffers everywhere (an empty slice's address is Open MPI's MPI_IN_PLACE).
    let mut empty = Vec::new();
    world
        .broadcast_bytes(&mut empty, 0, 0)
        .expect("empty broadcast");
    assert!(empty.is_empty());
    let all = world.all_gather_bytes(&[]).expect("empty all-gather");
    assert_eq!(all, vec![Vec::<u8>::new(); 3]);
    let e = world
        .broadcast_f32(&mut f, 3)
        .expect_err("root out of range");
    assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
}

fn subgroups(world: &dyn ProcessGroup) {
    let me = world.rank();
    // Colors by parity, keys reversing the order: {2, 0} and {1}.
    let sub = world
        .split(Some((me % 2) as u32 * 0x8000_0000), -(me as i64))
        .expect("split")
        .expect("a member");
    let members: Vec<usize> = (0..sub.size()).map(|r| sub.world_rank(r)).collect();
    assert_eq!(
        members,
        if me.is_multiple_of(2) {
            vec![2, 0]
        } else {
            vec![1]
        }
    );
    assert_eq!(sub.group_rank(me), Some(sub.rank()));
    let mut v = vec![me as f32 + 1.0];
    sub.all_reduce_sum(&mut v).expect("sub all-reduce");
    assert_eq!(v[0], if me.is_multiple_of(2) { 4.0 } else { 2.0 });
    let none = world
        .split(if me == 1 { None } else { Some(9) }, 0)
        .expect("split");
    assert_eq!(none.is_none(), me == 1);
    if me != 1 {
        // Only the members call `group`, in the new group's order.
        let g = world.group(&[2, 0]).expect("group");
        assert_eq!(
            (g.size(), g.world_rank(0), g.rank()),
            (2, 2, usize::from(me == 0))
        );
        let mut x = vec![1.0f32];
        g.all_reduce_sum(&mut x).expect("group all-reduce");
        assert_eq!(x[0], 2.0);
        assert!(world.group(&[0, 0]).is_err());
    }
    assert!(
        world.group(&[(me + 1) % 3]).is_err(),
        "a group without this rank"
    );
    world.barrier().expect("barrier after sub-groups");
}

fn tagged_messages(world: &dyn ProcessGroup) {
    let (me, n) = (world.rank(), world.size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let soon = || Instant::now() + Duration::from_secs(20);
    world.send(next, 5, b"a").expect("send");
    world.send(next, 0xFFFF_0001, b"b").expect("send");
    world.send(next, 5, b"c").expect("send");
    // 8 MiB to the next rank while the previous one sends 8 MiB here: no deadlock.
    let big = vec![me as u8; 8 << 20];
    world.send(next, 6, &big).expect("big send");
    assert_eq!(
        world.recv(prev, 0xFFFF_0001, soon()).expect("reserved tag"),
        b"b"
    );
    assert_eq!(world.recv(prev, 5, soon()).expect("first"), b"a");
    assert_eq!(world.recv(prev, 5, soon()).expect("second"), b"c");
    let got = world.recv(prev, 6, soon()).expect("big");
    assert!(got.len() == 8 << 20 && got.iter().all(|&x| x == prev as u8));
    world.send(me, 11, b"self").expect("to itself");
    assert_eq!(
        world.recv_any(&[next, me], 11, soon()).expect("self"),
        (me, b"self".to_vec())
    );
    // Nobody sends tag 99: the deadline names the silent peers.
    let t = Instant::now();
    let e = world
        .recv_any(&[next, prev], 99, t + Duration::from_millis(300))
        .expect_err("nothing under tag 99");
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    match e {
        CommError::Deadline { waiting_for, .. } => assert_eq!(waiting_for, vec![next, prev]),
        e => panic!("{e}"),
    }
    world.barrier().expect("barrier after messages");
}

fn deadline(world: &dyn ProcessGroup) -> bool {
    if world.rank() == 1 {
        // Late: rank 0's barrier passes its 1 s deadline first.
        std::thread::sleep(Duration::from_millis(2500));
        return world.barrier().is_ok();
    }
    let t = Instant::now();
    let e = world.barrier().expect_err("rank 1 is late");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(
        matches!(&e, CommError::Deadline { waiting_for, .. } if waiting_for == &vec![1]),
        "{e}"
    );
    let later = world.barrier().expect_err("poisoned");
    assert!(matches!(later, CommError::Poisoned(_)), "{later}");
    println!("deadline ok rank 0: {e}");
    false
}

fn abort(world: &Arc<dyn ProcessGroup>) -> bool {
    if world.rank() == 1 {
        std::thread::sleep(Duration::from_millis(1500));
        return world.barrier().is_ok();
    }
    let inspector = world.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        inspector.abort("stalled: test");
    });
    let started = Instant::now();
    let e = world.barrier().expect_err("aborted");
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(&e, CommError::Aborted { by: 0, reason } if reason == "stalled: test"),
        "{e}"
    );
    t.join().expect("inspector");
    println!("abort ok rank 0: {e}");
    false
}
