//! The derivation behind [`crate::ProcessGroup::split`] (whose provided body runs it for
//! every backend): every member all-gathers its (color, key) ([`encode`]); each then
//! derives ([`plan`]) the member list of its new group (ordered by `(key, rank)`) and the
//! same small color (the index of its color among the colors present) and key (its place in
//! the new group), which is what `MPI_Comm_split`, taking `int`s, needs. The backend builds
//! the group from the plan ([`crate::ProcessGroup::subgroup_from`]). Pure: no communication
//! here.

use crate::error::CommError;

/// Bytes of one member's encoded (color, key).
const LEN: usize = 13;

/// One member's choice, as all-gathered.
pub fn encode(color: Option<u32>, key: i64) -> Vec<u8> {
    let mut out = Vec::with_capacity(LEN);
    out.push(u8::from(color.is_some()));
    out.extend_from_slice(&color.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&key.to_le_bytes());
    out
}

fn decode(b: &[u8]) -> Option<(Option<u32>, i64)> {
    if b.len() != LEN || b[0] > 1 {
        return None;
    }
    let c = u32::from_le_bytes([b[1], b[2], b[3], b[4]]);
    let mut k = [0u8; 8];
    k.copy_from_slice(&b[5..LEN]);
    Some(((b[0] == 1).then_some(c), i64::from_le_bytes(k)))
}

/// Who this member's new group is, and its small color and key (for `MPI_Comm_split`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitPlan {
    /// This member's color as it passed it (`None`: it joins no group).
    pub color: Option<u32>,
    /// The index of this member's color among the colors present, and its place in its new
    /// group (`None`: it joins no group).
    pub mpi: Option<(i32, i32)>,
    /// The new group's members as ranks of the parent group, in the new group's order.
    pub members: Vec<usize>,
}

/// The plan of member `me` from everybody's encoded choice (`world` names a rank in errors).
pub fn plan(
    all: &[Vec<u8>],
    me: usize,
    world: impl Fn(usize) -> usize,
) -> Result<SplitPlan, CommError> {
    let mut parsed = Vec::with_capacity(all.len());
    for (r, b) in all.iter().enumerate() {
        parsed.push(decode(b).ok_or_else(|| CommError::Protocol {
            peer: world(r),
            detail: format!("split: malformed (color, key) of {} bytes", b.len()),
        })?);
    }
    let Some(&(Some(mine), _)) = parsed.get(me) else {
        return Ok(SplitPlan {
            color: None,
            mpi: None,
            members: Vec::new(),
        });
    };
    let mut colors: Vec<u32> = parsed.iter().filter_map(|(c, _)| *c).collect();
    colors.sort_unstable();
    colors.dedup();
    let color = colors.iter().position(|&c| c == mine).unwrap_or(0);
    let mut chosen: Vec<(i64, usize)> = parsed
        .iter()
        .enumerate()
        .filter(|(_, (c, _))| *c == Some(mine))
        .map(|(r, (_, k))| (*k, r))
        .collect();
    chosen.sort_unstable();
    let members: Vec<usize> = chosen.iter().map(|&(_, r)| r).collect();
    let key = members.iter().position(|&r| r == me).unwrap_or(0);
    let small = |v: usize| {
        i32::try_from(v)
            .map_err(|_| CommError::InvalidArgument(format!("split: {v} does not fit an MPI int")))
    };
    Ok(SplitPlan {
        color: Some(mine),
        mpi: Some((small(color)?, small(key)?)),
        members,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colors_and_keys_become_small_mpi_ints_ordered_by_key_then_rank() {
        let all = vec![
            encode(Some(0xFFFF_FFFF), 5),
            encode(Some(3), i64::MAX),
            encode(None, 0),
            encode(Some(3), i64::MIN),
            encode(Some(0xFFFF_FFFF), 5),
        ];
        let p = plan(&all, 1, |r| r).expect("plan");
        assert_eq!(p.color, Some(3));
        assert_eq!(p.mpi, Some((0, 1)));
        assert_eq!(p.members, vec![3, 1]);
        let p = plan(&all, 4, |r| r).expect("plan");
        assert_eq!(p.mpi, Some((1, 1)), "equal keys: rank order");
        assert_eq!(p.members, vec![0, 4]);
        let none = plan(&all, 2, |r| r).expect("plan");
        assert_eq!((none.color, none.mpi), (None, None));
    }

    #[test]
    fn a_malformed_entry_names_the_sender() {
        let all = vec![encode(Some(1), 0), vec![1, 2, 3]];
        let e = plan(&all, 0, |r| r + 10).expect_err("malformed");
        assert_eq!(e.blamed_rank(), Some(11));
    }
}
