//! The hierarchical `f32` all-reduce of a group spanning several hosts, with `k > 1` of its
//! ranks on every host ([`crate::Hierarchical::Auto`], the default):
//!
//! 1. each host's ranks all-reduce the whole buffer over their shared segment (the
//!    segment's own all-reduce, [`crate::flat::shm_all_reduce`]: a reduce-scatter and an
//!    all-gather in memory; every local rank then holds the host's sum);
//! 2. local rank `i` all-reduces segment `i` of `k` ([`flotilla_group::shard::segment`])
//!    over TCP with local rank `i` of every other host: `k` groups side by side, each
//!    carrying `1/k` of the buffer, with the flat TCP algorithm its size picks (recursive
//!    doubling, Rabenseifner's, the ring);
//! 3. each host gathers the segments over its shared segment (one broadcast from each local
//!    rank of its segment).
//!
//! **Sum order** (the same on every rank, so every rank ends with the same bits): each
//! host's sum is the serial left-to-right sum of its ranks in group order (the segment's);
//! the hosts' sums are then added in the order of the TCP algorithm of step 2 (the same
//! for a given size and host count), on every rank of that cross-host group alike, and
//! step 3 copies those bits to the rest of the host. It is within rounding of any serial
//! sum, not bitwise equal to the flat algorithms' (which add in other orders).
//!
//! **Bytes between hosts**: with `H` hosts, each rank sends `2 (H-1)/H · S/k` of an
//! all-reduce of `S` bytes over TCP, `2 (H-1) S` in all; a flat ring over the same ranks
//! (host by host) sends `2 (n-1)/n · S` from one rank per host, `H · 2 (n-1)/n · S` in all;
//! flat recursive doubling or Rabenseifner's `2 (H-1)/H · S` per rank (`k` times the
//! hierarchical). The cross-host latency is `2 (H-1)` (ring) or `2 log2 H` steps instead of
//! `2 (n-1)` or `2 log2 n`.
//!
//! **When** (decided once per group, by its first all-reduce, from the rendezvous' host
//! keys, so every member decides alike): the group spans at least two hosts, every host
//! holds the same number `k > 1` of its ranks, the transport is not `tcp`, and no host key
//! is unknown. Otherwise the flat path: a single host keeps its segment, one rank per host
//! the flat TCP algorithms, and **uneven hosts** (different counts) too: with `k_h` ranks
//! on host `h`, the segments of step 2 would not line up across hosts (host `h` cuts its
//! buffer into `k_h` parts), and any scheme that lines them up makes the rank of the
//! smallest host carry the largest share over its link, which then paces the whole step;
//! flat keeps every link's share equal.

use flotilla_group::{CommError, Members, shard};

use crate::config::{Hierarchical, Transport};
use crate::flat::{self, Algorithm};
use crate::world::{GroupState, Levels, derive_key};

/// Where the ranks of a group are, host by host.
#[derive(Debug, PartialEq, Eq)]
struct Plan {
    /// The group ranks of each host, hosts in order of their lowest group rank.
    hosts: Vec<Vec<usize>>,
    /// This rank's host (index into `hosts`).
    host: usize,
    /// This rank's position on its host (its local rank).
    local: usize,
}

/// The plan of a group whose rank `r` is on host `keys[r]`, for its rank `me`: `None`
/// when the all-reduce stays flat (one host, one rank per host, uneven hosts, an unknown
/// key, `me` not a member).
fn plan(keys: &[&str], me: usize) -> Option<Plan> {
    if me >= keys.len() || keys.iter().any(|k| k.is_empty()) {
        return None;
    }
    let mut hosts: Vec<(&str, Vec<usize>)> = Vec::new();
    for (r, &k) in keys.iter().enumerate() {
        match hosts.iter_mut().find(|(key, _)| *key == k) {
            Some((_, ranks)) => ranks.push(r),
            None => hosts.push((k, vec![r])),
        }
    }
    let k = hosts[0].1.len();
    if hosts.len() < 2 || k < 2 || hosts.iter().any(|(_, h)| h.len() != k) {
        return None;
    }
    let host = hosts.iter().position(|(key, _)| *key == keys[me])?;
    let local = hosts[host].1.iter().position(|&r| r == me)?;
    Some(Plan {
        hosts: hosts.into_iter().map(|(_, ranks)| ranks).collect(),
        host,
        local,
    })
}

/// The sub-groups of `g`'s hierarchical all-reduce, decided (and built) by its first
/// all-reduce; `None`: the flat path.
pub(crate) fn levels(g: &GroupState) -> Option<&Levels> {
    g.levels.get_or_init(|| build(g)).as_ref()
}

/// `g`'s host group (keyed by its host's index) and cross-host group (keyed by its local
/// rank), when the hierarchical all-reduce applies.
fn build(g: &GroupState) -> Option<Levels> {
    let (w, n) = (&g.world, g.members.len());
    if w.cfg.hierarchical == Hierarchical::Off || w.cfg.transport == Transport::Tcp {
        return None;
    }
    let keys: Vec<&str> = (0..n).map(|r| w.host(g.members.world_rank(r))).collect();
    let p = plan(&keys, g.me())?;
    let world = |ranks: &mut dyn Iterator<Item = usize>| -> Vec<usize> {
        ranks.map(|r| g.members.world_rank(r)).collect()
    };
    let key = |what: &[u8], i: usize| {
        let mut id = what.to_vec();
        id.extend_from_slice(&(i as u64).to_le_bytes());
        derive_key(g.key, &id)
    };
    let local = world(&mut p.hosts[p.host].iter().copied());
    let local = GroupState::new(
        w.clone(),
        key(b"hier-local", p.host),
        Members::new(local, p.local),
    );
    // Every member of a host sees the same keys and links, so all decide alike.
    local.shm.as_ref()?;
    let cross = world(&mut p.hosts.iter().map(|h| h[p.local]));
    let cross = GroupState::new(
        w.clone(),
        key(b"hier-cross", p.local),
        Members::new(cross, p.host),
    );
    Some(Levels { local, cross })
}

/// The hierarchical all-reduce of `buf` over `lv` (in the parent group's turn; see the
/// module doc).
pub(crate) async fn all_reduce(lv: &Levels, buf: &mut [f32]) -> Result<(), CommError> {
    let (local, cross): (&GroupState, &GroupState) = (&lv.local, &lv.cross);
    let (len, k, i) = (buf.len(), local.members.len(), local.me());
    let t = local.nested_ticket();
    {
        let _turn = local.begin(t).await?;
        flat::shm_all_reduce(local, t, buf).await?;
    }
    let t = cross.nested_ticket();
    {
        let _turn = cross.begin(t).await?;
        let mine = &mut buf[shard::segment(len, k, i)];
        Algorithm::of(cross, mine).run(cross, t, mine).await?;
    }
    for j in 0..k {
        let t = local.nested_ticket();
        let _turn = local.begin(t).await?;
        flat::shm_broadcast(local, t, &mut buf[shard::segment(len, k, j)], j).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_in_order_of_their_first_rank_and_flat_unless_even() {
        let p = plan(&["b", "a", "b", "a"], 1).expect("2 hosts x 2");
        assert_eq!(p.hosts, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!((p.host, p.local), (1, 0));
        let p = plan(&["a", "a", "b", "b", "c", "c"], 5).expect("3 hosts x 2");
        assert_eq!((p.host, p.local), (2, 1));
        assert_eq!(plan(&["a", "a", "b"], 0), None, "uneven hosts");
        assert_eq!(plan(&["a", "b", "c"], 0), None, "one rank per host");
        assert_eq!(plan(&["a", "a", "a"], 0), None, "one host");
        assert_eq!(plan(&["a", "a", "", ""], 0), None, "an unknown host");
        assert_eq!(plan(&["a", "a", "b", "b"], 4), None, "not a member");
    }
}
