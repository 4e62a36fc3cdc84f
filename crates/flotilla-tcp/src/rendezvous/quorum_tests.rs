//! The lighthouse's membership rules, event by event.

use super::*;

fn bounds() -> Bounds {
    Bounds {
        min: 2,
        max: 3,
        first: 3,
        join_timeout: Duration::from_secs(10),
        agreement: Duration::from_secs(2),
        mesh: Duration::from_secs(4),
        unit: 1,
    }
}

/// `step` 0 of generation 0: a new process, without state.
fn enlisted(slot: u64, generation: u64, step: u64) -> Enlisted {
    Enlisted {
        slot,
        addr: format!("127.0.0.1:{}", 4000 + slot),
        mesh_addr: format!("127.0.0.1:{}", 5000 + slot),
        host: "h".into(),
        generation,
        step: (generation > 0).then_some(step),
        protocol: RENDEZVOUS_PROTOCOL,
        config_hash: 7,
    }
}

/// The `Formed` sent to each slot: (slot, generation, rank, slots, step).
fn formed(out: &[Out]) -> Vec<(u64, u64, usize, Vec<u64>, u64)> {
    out.iter()
        .filter_map(|o| match o {
            Out::Send(
                slot,
                Ctrl::Formed(Formed {
                    generation,
                    rank,
                    slots,
                    step,
                    ..
                }),
            ) => Some((*slot, *generation, *rank, slots.clone(), *step)),
            _ => None,
        })
        .collect()
}

fn regroups(out: &[Out]) -> Vec<u64> {
    out.iter()
        .filter_map(|o| match o {
            Out::Send(slot, Ctrl::Regroup { .. }) => Some(*slot),
            _ => None,
        })
        .collect()
}

fn rejection(out: &[Out]) -> Option<RendezvousError> {
    out.iter().find_map(|o| match o {
        Out::Send(_, Ctrl::Reject(re)) => Some(re.clone()),
        _ => None,
    })
}

/// Slots 0, 1, 2 form generation 1 and are running.
fn running(t: Instant) -> Quorum {
    let mut q = Quorum::new(bounds(), t);
    assert!(q.enlist(enlisted(0, 0, 0), t).is_empty());
    assert!(q.enlist(enlisted(1, 0, 0), t).is_empty());
    let out = q.enlist(enlisted(2, 0, 0), t);
    let f = formed(&out);
    assert_eq!(f.len(), 3, "{out:?}");
    assert!(
        f.iter()
            .all(|(_, g, _, slots, _)| *g == 1 && slots == &[0, 1, 2])
    );
    assert!(q.ready(0, t).is_empty());
    assert!(q.ready(1, t).is_empty());
    let out = q.ready(2, t);
    assert!(out.contains(&Out::Running(1, vec![0, 1, 2])), "{out:?}");
    assert_eq!(
        out.iter()
            .filter(|o| matches!(o, Out::Send(_, Ctrl::Go)))
            .count(),
        3
    );
    q
}

#[test]
fn a_lost_member_leaves_a_generation_of_the_others_led_by_the_most_steps() {
    let t = Instant::now();
    let mut q = running(t);
    let out = q.closed(0, t);
    assert_eq!(regroups(&out), vec![1, 2], "the survivors are told at once");
    assert!(q.enlist(enlisted(2, 1, 41), t).is_empty());
    let out = q.enlist(enlisted(1, 1, 40), t);
    // Slot 2 finished step 41, slot 1 did not: slot 2 leads and everyone resumes at 41.
    assert_eq!(
        formed(&out),
        vec![(2, 2, 0, vec![2, 1], 41), (1, 2, 1, vec![2, 1], 41)]
    );
}

#[test]
fn a_member_silent_past_the_agreement_deadline_is_left_out_and_refused_when_it_wakes() {
    let t = Instant::now();
    let mut q = running(t);
    // Slot 1 saw its collective fail; slot 2 is frozen (its connection stays open).
    let out = q.enlist(enlisted(1, 1, 5), t);
    assert_eq!(regroups(&out), vec![0, 2]);
    assert!(
        q.enlist(enlisted(0, 1, 5), t).is_empty(),
        "slot 2 is awaited"
    );
    assert!(q.tick(t + Duration::from_secs(1)).is_empty());
    let out = q.tick(t + Duration::from_secs(3));
    assert_eq!(formed(&out).len(), 2, "{out:?}");
    // Slot 2 wakes up in generation 1: refused, and closed.
    let out = q.enlist(enlisted(2, 1, 5), t + Duration::from_secs(4));
    assert!(
        matches!(
            rejection(&out),
            Some(RendezvousError::StaleGeneration {
                generation: 1,
                current: 2,
                ..
            })
        ),
        "{out:?}"
    );
    assert!(out.contains(&Out::Close(2)));
}

#[test]
fn below_the_minimum_the_job_ends_at_once_naming_the_lost() {
    let t = Instant::now();
    let mut q = running(t);
    q.closed(0, t);
    let out = q.closed(1, t);
    assert!(formed(&out).is_empty());
    // Slot 2, the last, enlists: alone it is below the minimum of 2, and nobody else is
    // awaited, so the deadline is not waited for.
    let out = q.enlist(enlisted(2, 1, 9), t);
    let Some(Out::Failed(RendezvousError::BelowMinimum { min, present, lost })) =
        out.iter().find(|o| matches!(o, Out::Failed(_))).cloned()
    else {
        panic!("{out:?}");
    };
    assert_eq!((min, present), (2, 1));
    assert!(
        lost.contains("slot 0 (rank 0 of generation 1)") && lost.contains("slot 1"),
        "{lost}"
    );
    assert!(rejection(&out).is_some(), "slot 2 is told why");
    assert!(q.failed());
}

#[test]
fn a_joiner_waits_for_a_step_boundary_and_comes_in_last() {
    let t = Instant::now();
    let mut q = Quorum::new(
        Bounds {
            min: 2,
            max: 3,
            ..bounds()
        },
        t,
    );
    q.enlist(enlisted(0, 0, 0), t);
    q.enlist(enlisted(1, 0, 0), t);
    // The first generation forms at the join deadline with the two there.
    let out = q.tick(t + Duration::from_secs(11));
    assert_eq!(formed(&out).len(), 2);
    // A joiner while the mesh is built waits for it to run, then every member is told.
    assert!(q.enlist(enlisted(9, 0, 0), t).is_empty());
    q.ready(0, t);
    let out = q.ready(1, t);
    assert!(out.contains(&Out::Running(1, vec![0, 1])));
    assert_eq!(regroups(&out), vec![0, 1]);
    q.enlist(enlisted(1, 1, 30), t);
    let out = q.enlist(enlisted(0, 1, 30), t);
    assert_eq!(
        formed(&out).iter().map(|f| (f.0, f.2)).collect::<Vec<_>>(),
        vec![(0, 0), (1, 1), (9, 2)]
    );
    // Full: a fourth process is refused.
    let out = q.enlist(enlisted(10, 0, 0), t);
    assert!(
        matches!(
            rejection(&out),
            Some(RendezvousError::JobFull { max: 3, .. })
        ),
        "{out:?}"
    );
}

#[test]
fn another_config_and_a_claimed_slot_are_refused() {
    let t = Instant::now();
    let mut q = running(t);
    let mut other = enlisted(5, 0, 0);
    other.config_hash = 8;
    let out = q.enlist(other, t);
    assert!(matches!(
        rejection(&out),
        Some(RendezvousError::ConfigHashMismatch { .. })
    ));
    let out = q.enlist(enlisted(1, 0, 0), t);
    assert!(matches!(
        rejection(&out),
        Some(RendezvousError::DuplicateRank { .. })
    ));
    assert_eq!(q.generation(), 1);
}

#[test]
fn a_mesh_that_fails_forms_the_generation_again() {
    let t = Instant::now();
    let mut q = running(t);
    q.closed(2, t);
    q.enlist(enlisted(0, 1, 3), t);
    q.enlist(enlisted(1, 1, 3), t);
    let out = q.mesh_failed(1, t);
    assert_eq!(regroups(&out), vec![0, 1]);
    q.enlist(enlisted(1, 2, 3), t);
    let out = q.enlist(enlisted(0, 2, 3), t);
    assert!(formed(&out).iter().all(|f| f.1 == 3), "{out:?}");
}

#[test]
fn members_that_leave_a_finished_job_are_not_lost_and_nobody_joins_it() {
    let t = Instant::now();
    let mut q = running(t);
    assert_eq!(q.finished(1), vec![Out::Finished]);
    assert!(q.finished(2).is_empty(), "said once");
    for slot in [1, 0, 2] {
        assert!(
            q.closed(slot, t).is_empty(),
            "slot {slot}: no generation after the end"
        );
    }
    assert!(q.tick(t + Duration::from_secs(60)).is_empty());
    assert!(!q.failed());
    let out = q.enlist(enlisted(7, 0, 0), t);
    assert!(
        matches!(rejection(&out), Some(RendezvousError::MasterFailed { reason }) if reason.contains("finished")),
        "{out:?}"
    );
}

fn standbys(out: &[Out]) -> Vec<u64> {
    out.iter()
        .filter_map(|o| match o {
            Out::Send(slot, Ctrl::Standby { .. }) => Some(*slot),
            _ => None,
        })
        .collect()
}

/// Replicas of two ranks (a pipeline of two stages), 2 to 4 ranks: slot 1 (rank 1, stage
/// 1 of replica 0) is lost; of the three survivors one replica goes on, each at the stage
/// it ran (slot 0 stage 0, slot 3 stage 1), and slot 2 stands by (told so again while it
/// waits) without the running generation forming again; a joiner makes two replicas again,
/// the survivors at their stages; at the job's end a process standing by is told why.
#[test]
fn replicas_of_two_ranks_form_whole_and_a_process_left_over_stands_by() {
    let t = Instant::now();
    let b = Bounds {
        min: 2,
        max: 4,
        first: 4,
        unit: 2,
        ..bounds()
    };
    let mut q = Quorum::new(b, t);
    for slot in 0..4 {
        q.enlist(enlisted(slot, 0, 0), t);
    }
    (0..4).for_each(|s| drop(q.ready(s, t)));
    let out = q.closed(1, t);
    assert_eq!(regroups(&out), vec![0, 2, 3]);
    assert!(q.enlist(enlisted(0, 1, 7), t).is_empty());
    assert!(q.enlist(enlisted(2, 1, 7), t).is_empty());
    let out = q.enlist(enlisted(3, 1, 7), t);
    assert_eq!(
        formed(&out),
        vec![(0, 2, 0, vec![0, 3], 7), (3, 2, 1, vec![0, 3], 7)]
    );
    assert_eq!(standbys(&out), vec![2]);
    q.ready(0, t);
    let out = q.ready(3, t);
    assert!(out.contains(&Out::Running(2, vec![0, 3])), "{out:?}");
    assert!(
        regroups(&out).is_empty(),
        "one waiting process fills no replica"
    );
    let later = t + Duration::from_secs(3);
    assert_eq!(
        standbys(&q.tick(later)),
        vec![2],
        "told again while it waits"
    );
    // A joiner: two whole replicas again, the survivors at the stages they ran.
    let out = q.enlist(enlisted(9, 0, 0), later);
    assert_eq!(regroups(&out), vec![0, 3]);
    q.enlist(enlisted(0, 2, 9), later);
    let out = q.enlist(enlisted(3, 2, 9), later);
    let ranks: Vec<(u64, usize)> = formed(&out).iter().map(|f| (f.0, f.2)).collect();
    assert_eq!(ranks, vec![(0, 0), (3, 1), (2, 2), (9, 3)], "{out:?}");
    (0..4).for_each(|s| drop(q.ready([0, 3, 2, 9][s], later)));
    // Slot 3 is lost: slot 9 (stage 1) takes its place, slot 2 (stage 0) stands by; the
    // job then finishes.
    q.closed(3, later);
    q.enlist(enlisted(0, 3, 11), later);
    q.enlist(enlisted(2, 3, 11), later);
    let out = q.enlist(enlisted(9, 3, 11), later);
    assert_eq!(standbys(&out), vec![2], "{out:?}");
    q.ready(0, later);
    q.ready(9, later);
    let out = q.finished(0);
    assert!(out.contains(&Out::Finished));
    assert!(
        matches!(rejection(&out), Some(RendezvousError::StoodBy { .. })),
        "{out:?}"
    );
    assert!(out.contains(&Out::Close(2)), "{out:?}");
}
