//! The handover rules of an elastic pipeline's generations, and the header's wire form.

use super::*;

fn header(committed: u64, stage: Option<usize>, at: u64, undoable: bool) -> Header {
    Header {
        committed,
        stage,
        at,
        undoable,
        lineage: 1,
        cut: vec![[0, 3], [3, 7]],
    }
}

/// A process that stood by while the others trained on (an older lineage) holds its stage
/// at the generation's count of steps, but not the others' state: its own update of a step
/// that finished nowhere, which the others redid without it. The stage comes from the newest
/// lineage, whose steps count; the standby takes it.
#[test]
fn a_standbys_state_of_an_older_lineage_is_not_the_generations_even_at_its_step() {
    let standby = Header {
        lineage: 1,
        ..header(313, Some(0), 314, true)
    };
    let newer = |stage| Header {
        lineage: 2,
        ..header(314, Some(stage), 314, false)
    };
    let headers = [standby.clone(), newer(0), newer(1), newer(1)];
    let h = choose(&headers, 2).expect("handover");
    assert_eq!((h.step, h.holders.clone()), (314, vec![Some(1), Some(2)]));
    assert!(!h.held_by(&standby, 0), "the standby takes stage 0");
    // Its steps do not count either: a standby that finished more is rolled back.
    let ahead = Header {
        lineage: 1,
        ..header(320, Some(0), 320, false)
    };
    let h = choose(&[ahead, newer(0), newer(1)], 2).expect("handover");
    assert_eq!((h.step, h.holders), (314, vec![Some(1), Some(2)]));
}

/// Each stage from the lowest-ranked member holding it at the generation's step (the most
/// steps finished); a member whose update ran in a step that finished nowhere gives the
/// state from before it; a joiner gives nothing.
#[test]
fn each_stage_comes_from_a_member_holding_it_at_the_generations_step() {
    let headers = [
        header(9, Some(0), 10, true), // updated in step 10, which did not finish here
        Header::default(),            // a joiner
        header(9, Some(1), 9, false),
        header(9, Some(1), 10, true),
    ];
    let h = choose(&headers, 2).expect("handover");
    assert_eq!((h.step, h.holders), (9, vec![Some(0), Some(2)]));
    // Step 10 finished on one member: every member's update of it stands.
    let headers = [header(9, Some(0), 10, true), header(10, Some(1), 10, false)];
    let h = choose(&headers, 2).expect("handover");
    assert_eq!((h.step, h.holders), (10, vec![Some(0), Some(1)]));
}

/// A stage nobody holds at the step ends the job naming it; at step 0 (every member new)
/// stages are built from the seed.
#[test]
fn a_stage_nobody_holds_is_named_and_step_0_starts_from_the_seed() {
    let headers = [header(9, Some(0), 9, false), header(9, Some(0), 9, false)];
    let e = choose(&headers, 2).expect_err("stage 1 lost").to_string();
    assert!(e.contains("stage 1 at step 9"), "{e}");
    let h = choose(&[Header::default(), Header::default()], 2).expect("fresh");
    assert_eq!((h.step, h.holders), (0, vec![None, None]));
    // A stale state (an old standby's) is not the step's.
    let headers = [header(9, Some(0), 9, false), header(4, Some(1), 4, false)];
    assert!(choose(&headers, 2).is_err());
}

#[test]
fn a_header_survives_the_wire_and_malformed_ones_are_refused() {
    for h in [header(7, Some(1), 8, true), Header::default()] {
        assert_eq!(Header::decode(&h.encode(), 3).expect("decodes"), h);
    }
    let good = header(1, Some(0), 1, false).encode();
    for bad in [
        Vec::new(),
        good[..good.len() - 8].to_vec(),
        good[..good.len() - 1].to_vec(),
        [&good[..40], &u64::MAX.to_le_bytes()[..], &good[48..]].concat(),
    ] {
        let e = Header::decode(&bad, 3).expect_err("malformed");
        assert!(matches!(e, TrainError::Protocol { peer: 3, .. }), "{e}");
    }
}
