//! An elastic job's membership over real sockets: a lighthouse outside the ranks, each
//! process's beacon, one generation after another. A lost member leaves the others a
//! generation of their own (led by the member that holds the most steps); a joiner is
//! announced to the members, which enlist again and take it in last; a member silent past
//! the agreement timeout is left out and refused when it comes back; below the minimum the
//! job ends naming the lost.

use std::net::TcpListener;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::{
    Beacon, CommConfig, CommError, Generation, Lighthouse, LighthouseConfig, LighthouseEvent,
    ProcessGroup, RendezvousError, Secret, TcpGroup,
};

fn secret() -> Secret {
    Secret::new(b"flotilla-elastic-test-secret-0123456789".to_vec()).expect("secret")
}

/// A lighthouse of `min:max` ranks on a free loopback port.
fn lighthouse(min: usize, max: usize) -> Lighthouse {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let cfg = LighthouseConfig {
        min,
        max,
        first: max,
        secret: Some(secret()),
        tls: None,
        insecure: false,
        join_timeout: Duration::from_secs(10),
        agreement: Duration::from_secs(2),
        timeout: Duration::from_secs(3),
        unit: 1,
    };
    Lighthouse::start(cfg, l).expect("lighthouse")
}

fn cfg(port: u16) -> CommConfig {
    CommConfig::new(None, 1)
        .with_secret(Some(secret()))
        .with_master("127.0.0.1", port)
        .with_timeout(Duration::from_secs(3))
        .with_join_timeout(Duration::from_secs(10))
        .with_config_hash(42)
}

type Joined = (u64, Beacon, Result<(TcpGroup, Generation), CommError>);

/// Process `slot` joins (with `step`) on a thread of its own.
fn join(port: u16, slot: u64, beacon: Option<Beacon>, step: Option<u64>, tx: mpsc::Sender<Joined>) {
    thread::spawn(move || {
        let mut beacon =
            beacon.unwrap_or_else(|| Beacon::connect(&cfg(port), slot).expect("beacon"));
        let joined = TcpGroup::connect_elastic(cfg(port), &mut beacon, step);
        let _ = tx.send((slot, beacon, joined));
    });
}

fn collect(rx: &mpsc::Receiver<Joined>, n: usize) -> Vec<(u64, Beacon, TcpGroup, Generation)> {
    let mut got: Vec<_> = (0..n)
        .map(|_| {
            let (slot, b, r) = rx.recv_timeout(Duration::from_secs(30)).expect("a member");
            let (g, generation) = r.unwrap_or_else(|e| panic!("slot {slot}: {e}"));
            (slot, b, g, generation)
        })
        .collect();
    got.sort_by_key(|m| m.2.rank());
    got
}

/// Every member sums its slot: the group is whole and in rank order.
fn sum_of_slots(members: &[(u64, Beacon, TcpGroup, Generation)]) -> Vec<f32> {
    thread::scope(|s| {
        let handles: Vec<_> = members
            .iter()
            .map(|(slot, _, g, _)| {
                s.spawn(move || {
                    let mut v = vec![*slot as f32];
                    g.all_reduce_sum(&mut v).expect("all-reduce");
                    v[0]
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("member"))
            .collect()
    })
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < until, "{what}: not within 20 s");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn members_lost_and_joining_make_new_generations_without_stopping_the_others() {
    let lh = lighthouse(2, 3);
    let port = lh.port();
    let (tx, rx) = mpsc::channel();
    for slot in [10, 11, 12] {
        join(port, slot, None, None, tx.clone());
    }
    let members = collect(&rx, 3);
    let first: Vec<u64> = members.iter().map(|m| m.0).collect();
    assert!(
        members
            .iter()
            .all(|m| m.3.number == 1 && m.3.slots == first)
    );
    assert_eq!(sum_of_slots(&members), vec![33.0; 3]);
    assert_eq!(
        lh.try_event(),
        Some(LighthouseEvent::Running {
            generation: 1,
            slots: first.clone()
        })
    );

    // The last member is lost: the others hear of it, and the one that holds one more step
    // (its update went through) leads the next generation.
    let mut members = members;
    let lost = members.pop().expect("a member");
    drop(lost);
    wait_for("the survivors hear of the loss", || {
        members.iter().all(|m| m.1.changing())
    });
    for (i, (slot, beacon, group, _)) in members.into_iter().enumerate() {
        drop(group);
        join(port, slot, Some(beacon), Some(40 + i as u64), tx.clone());
    }
    let members = collect(&rx, 2);
    assert_eq!(members[0].0, first[1], "the member with step 41 leads");
    assert!(members.iter().all(|m| m.3.number == 2 && m.3.step == 41));
    assert_eq!(
        sum_of_slots(&members),
        vec![(first[0] + first[1]) as f32; 2]
    );

    // A new process: the members are told, enlist again at their step boundary, and it
    // comes in last.
    join(port, 20, None, None, tx.clone());
    wait_for("the members hear of the joiner", || {
        members.iter().all(|m| m.1.changing())
    });
    for (slot, beacon, group, _) in members {
        drop(group);
        join(port, slot, Some(beacon), Some(41), tx.clone());
    }
    let members = collect(&rx, 3);
    assert!(
        members.iter().all(|m| m.3.number == 3),
        "{:?}",
        members[0].3
    );
    assert_eq!(members[2].0, 20);
    let total = (first[0] + first[1] + 20) as f32;
    assert_eq!(sum_of_slots(&members), vec![total; 3]);
}

#[test]
fn a_member_frozen_past_the_agreement_is_left_out_and_refused_when_it_wakes() {
    let lh = lighthouse(2, 3);
    let port = lh.port();
    let (tx, rx) = mpsc::channel();
    for slot in [1, 2, 3] {
        join(port, slot, None, None, tx.clone());
    }
    let mut members = collect(&rx, 3);
    // Rank 1 "freezes": it stays connected and silent while the others enlist again.
    let frozen = members.remove(1);
    for (slot, beacon, group, _) in members {
        drop(group);
        join(port, slot, Some(beacon), Some(7), tx.clone());
    }
    let members = collect(&rx, 2);
    assert!(members.iter().all(|m| m.3.number == 2));
    assert!(!members.iter().any(|m| m.0 == frozen.0));
    // It wakes up into generation 1 and is refused, naming both generations.
    let (slot, mut beacon, group, _) = frozen;
    drop(group);
    let e = TcpGroup::connect_elastic(cfg(port), &mut beacon, Some(7)).expect_err("stale");
    assert!(
        matches!(
            &e,
            CommError::Rendezvous(RendezvousError::StaleGeneration {
                generation: 1,
                current: 2,
                ..
            })
        ),
        "slot {slot}: {e}"
    );
    assert_eq!(
        sum_of_slots(&members).len(),
        2,
        "the others are undisturbed"
    );
}

#[test]
fn below_the_minimum_every_member_is_told_and_the_lighthouse_names_the_lost() {
    let lh = lighthouse(2, 2);
    let port = lh.port();
    let (tx, rx) = mpsc::channel();
    for slot in [5, 6] {
        join(port, slot, None, None, tx.clone());
    }
    let mut members = collect(&rx, 2);
    let lost = members.remove(0);
    let lost_slot = lost.0;
    drop(lost);
    let (slot, mut beacon, group, _) = members.remove(0);
    drop(group);
    let started = Instant::now();
    let e = TcpGroup::connect_elastic(cfg(port), &mut beacon, Some(3)).expect_err("below min");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "it did not wait for the deadline"
    );
    let CommError::Rendezvous(RendezvousError::BelowMinimum { min, present, lost }) = &e else {
        panic!("slot {slot}: {e}");
    };
    assert_eq!((*min, *present), (2, 1));
    assert!(
        lost.contains(&format!("slot {lost_slot} (rank 0 of generation 1)")),
        "{lost}"
    );
    wait_for("the lighthouse reports it", || {
        matches!(lh.try_event(), Some(LighthouseEvent::Failed(_)))
    });
}

#[test]
fn a_process_without_the_secret_is_refused_and_the_job_forms_without_it() {
    let lh = lighthouse(2, 2);
    let port = lh.port();
    let wrong = cfg(port).with_secret(Some(
        Secret::new(b"another-secret-0123456789abcdef".to_vec()).expect("s"),
    ));
    assert!(Beacon::connect(&wrong, 99).is_err(), "a stranger got in");
    let (tx, rx) = mpsc::channel();
    for slot in [1, 2] {
        join(port, slot, None, None, tx.clone());
    }
    let members = collect(&rx, 2);
    assert_eq!(sum_of_slots(&members), vec![3.0; 2]);
}
