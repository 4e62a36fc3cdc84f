//! Balanced shard ranges of the flat parameter buffer.

use std::ops::Range;

use flotilla_cluster::{Aggregation, Arch, ServerSpec, Topology, TopologySpec, balanced_ranges};

fn lens(ranges: &[Range<usize>]) -> Vec<usize> {
    ranges.iter().map(|r| r.len()).collect()
}

#[test]
fn ten_over_three() {
    let r = balanced_ranges(10, 3);
    assert_eq!(r, vec![0..4, 4..7, 7..10]);
    assert_eq!(lens(&r), vec![4, 3, 3]);
}

#[test]
fn fewer_params_than_shards() {
    let r = balanced_ranges(2, 3);
    assert_eq!(r, vec![0..1, 1..2, 2..2]);
    assert_eq!(lens(&r), vec![1, 1, 0]);
    assert_eq!(balanced_ranges(0, 2), vec![0..0, 0..0]);
    assert!(balanced_ranges(5, 0).is_empty());
}

#[test]
fn always_balanced_and_covering() {
    for total in 0..50 {
        for parts in 1..9 {
            let r = balanced_ranges(total, parts);
            assert_eq!(r.len(), parts);
            assert_eq!(r.first().map(|x| x.start), Some(0));
            assert_eq!(r.last().map(|x| x.end), Some(total));
            assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            let l = lens(&r);
            let (min, max) = (l.iter().min().copied(), l.iter().max().copied());
            assert!(
                max.zip(min).is_some_and(|(a, b)| a - b <= 1),
                "{total}/{parts}: {l:?}"
            );
        }
    }
}

#[test]
fn topology_uses_its_shard_count() -> Result<(), flotilla_cluster::ClusterError> {
    let t = Topology::build(&TopologySpec {
        arch: Arch::Flat,
        parameter_server: Some(ServerSpec {
            aggr_type: Aggregation::Sync,
            num_workers: 2,
        }),
        global_server: None,
        servers: 3,
    })?;
    assert_eq!(lens(&t.shard_ranges(10)), vec![4, 3, 3]);
    assert_eq!(lens(&t.shard_ranges(2)), vec![1, 1, 0]);
    Ok(())
}
