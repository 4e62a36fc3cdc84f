//! The members of a process group: the world rank of each group rank and this process's
//! place, with the checks every [`crate::ProcessGroup`] implementation makes on ranks it is
//! given.

use crate::error::CommError;

/// The world rank of each group rank, and this process's group rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Members {
    world: Vec<usize>,
    me: usize,
}

impl Members {
    /// A group of `world` (world ranks, in group order) in which this process is `me`.
    pub fn new(world: Vec<usize>, me: usize) -> Self {
        Self { world, me }
    }

    /// This process's group rank.
    pub fn me(&self) -> usize {
        self.me
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.world.len()
    }

    /// Whether the group has no members.
    pub fn is_empty(&self) -> bool {
        self.world.is_empty()
    }

    /// The world rank of each group rank.
    pub fn world_ranks(&self) -> &[usize] {
        &self.world
    }

    /// The world rank of group rank `rank` (`usize::MAX` if out of range).
    pub fn world_rank(&self, rank: usize) -> usize {
        self.world.get(rank).copied().unwrap_or(usize::MAX)
    }

    /// The world rank of group rank `rank`, or an error naming `what` for one out of range.
    pub fn world_rank_checked(&self, rank: usize, what: &str) -> Result<usize, CommError> {
        self.world
            .get(rank)
            .copied()
            .ok_or_else(|| out_of_range(what, rank, self.world.len()))
    }

    /// The group rank of world rank `world_rank`, if it is a member.
    pub fn group_rank(&self, world_rank: usize) -> Option<usize> {
        self.world.iter().position(|&w| w == world_rank)
    }

    /// The world ranks of the other members.
    pub fn others(&self) -> Vec<usize> {
        let me = self.world.get(self.me).copied();
        self.world
            .iter()
            .copied()
            .filter(|&w| Some(w) != me)
            .collect()
    }

    /// The world ranks of the sub-group of group ranks `ranks` (in that order), checked:
    /// each in range, none twice, this process among them.
    pub fn subgroup(&self, ranks: &[usize]) -> Result<Vec<usize>, CommError> {
        let mut world = Vec::with_capacity(ranks.len());
        for &r in ranks {
            let w = self.world_rank_checked(r, "group")?;
            if world.contains(&w) {
                return Err(CommError::InvalidArgument(format!(
                    "group: rank {r} listed twice in {ranks:?}"
                )));
            }
            world.push(w);
        }
        if !ranks.contains(&self.me) {
            return Err(CommError::InvalidArgument(format!(
                "group: this process (rank {}) is not in {ranks:?}",
                self.me
            )));
        }
        Ok(world)
    }
}

/// The error for group rank `rank` given to `what` in a group of `len`.
pub(crate) fn out_of_range(what: &str, rank: usize, len: usize) -> CommError {
    CommError::InvalidArgument(format!(
        "{what}: rank {rank} is out of range for a group of {len}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_map_both_ways_and_subgroups_are_checked() {
        let m = Members::new(vec![4, 2, 7], 1);
        assert_eq!((m.me(), m.len()), (1, 3));
        assert_eq!(m.world_rank(2), 7);
        assert_eq!(m.world_rank(3), usize::MAX);
        assert_eq!(m.group_rank(7), Some(2));
        assert_eq!(m.group_rank(5), None);
        assert_eq!(m.others(), vec![4, 7]);
        assert_eq!(m.subgroup(&[2, 1]).expect("ok"), vec![7, 2]);
        let e = |r: &[usize]| m.subgroup(r).expect_err("refused").to_string();
        assert!(e(&[1, 1]).contains("listed twice"));
        assert!(e(&[1, 3]).contains("out of range"));
        assert!(e(&[0, 2]).contains("not in"));
        assert!(
            m.world_rank_checked(9, "send")
                .expect_err("out")
                .to_string()
                .contains("send: rank 9")
        );
    }
}
