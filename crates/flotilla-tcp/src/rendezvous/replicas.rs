//! A generation of whole replicas ([`super::quorum::Bounds::unit`] ranks each: a pipeline's
//! replica takes one process per stage): which processes are members, at which rank, and
//! which stand by. Rank `r` runs stage `r % unit`, so a survivor is placed where it runs the
//! stage it ran (its state needs no transfer); the places left go to processes standing by,
//! then to joiners; what fills no whole replica stands by.

use std::collections::VecDeque;

/// `survivors` (the previous generation's members that enlisted again, with their ranks
/// there) and `others` (processes standing by, then joiners) as the members of a generation
/// of at most `max` ranks in whole replicas of `unit`, by rank, and the processes left out.
pub(crate) fn arrange<P: Clone>(
    survivors: Vec<(usize, P)>,
    others: Vec<P>,
    unit: usize,
    max: usize,
) -> (Vec<P>, Vec<P>) {
    let unit = unit.max(1);
    let total = survivors.len() + others.len();
    let replicas = (total / unit).min(max / unit);
    let mut by_stage: Vec<VecDeque<P>> = vec![VecDeque::new(); unit];
    for (old_rank, e) in survivors {
        by_stage[old_rank % unit].push_back(e);
    }
    let mut others: VecDeque<P> = others.into();
    let mut members = Vec::with_capacity(replicas * unit);
    for _ in 0..replicas {
        for queue in 0..unit {
            let next = match by_stage[queue].pop_front() {
                Some(e) => Some(e),
                None => others.pop_front().or_else(|| {
                    // A survivor of another stage (it takes this stage's state).
                    let longest = (0..unit).max_by_key(|&s| by_stage[s].len())?;
                    by_stage[longest].pop_back()
                }),
            };
            members.extend(next);
        }
    }
    let rest = by_stage.into_iter().flatten().chain(others).collect();
    (members, rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process, by its slot.
    fn e(slot: u64) -> u64 {
        slot
    }

    fn slots(v: &[u64]) -> Vec<u64> {
        v.to_vec()
    }

    /// Two replicas of two stages lose rank 1 (replica 0's stage 1): one replica goes on
    /// with the survivors at the stages they ran (slot 0 stage 0, slot 3 stage 1), slot 2
    /// stands by; with a joiner, two replicas again, the survivors at their stages.
    #[test]
    fn survivors_keep_their_stage_and_what_fills_no_replica_stands_by() {
        let survivors = || vec![(0, e(0)), (2, e(2)), (3, e(3))];
        let (members, rest) = arrange(survivors(), vec![], 2, 4);
        assert_eq!((slots(&members), slots(&rest)), (vec![0, 3], vec![2]));
        let (members, rest) = arrange(survivors(), vec![e(9)], 2, 4);
        assert_eq!((slots(&members), slots(&rest)), (vec![0, 3, 2, 9], vec![]));
        // Every survivor ran stage 0: the second takes stage 1's place (and its state).
        let (members, rest) = arrange(vec![(0, e(0)), (2, e(2))], vec![], 2, 4);
        assert_eq!((slots(&members), slots(&rest)), (vec![0, 2], vec![]));
        // Never more than `max`, never a part of a replica.
        let (members, rest) = arrange(survivors(), vec![e(8), e(9)], 2, 4);
        assert_eq!((members.len(), rest.len()), (4, 1));
        let (members, rest) = arrange(vec![(1, e(1))], vec![], 2, 4);
        assert_eq!((members.len(), slots(&rest)), (0, vec![1]));
    }
}
