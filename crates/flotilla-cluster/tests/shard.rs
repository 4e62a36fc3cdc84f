//! Shard ranges of the flat parameter buffer: the ring's segments, one rule for parameter
//! servers and ZeRO.

use std::ops::Range;

use flotilla_cluster::{Aggregation, Arch, ServerSpec, Topology, TopologySpec};

fn lens(ranges: &[Range<usize>]) -> Vec<usize> {
    ranges.iter().map(|r| r.len()).collect()
}

fn flat(servers: usize) -> Topology {
    Topology::build(&TopologySpec {
        arch: Arch::Flat,
        parameter_server: Some(ServerSpec {
            aggr_type: Aggregation::Sync,
            num_workers: 2,
        }),
        global_server: None,
        servers,
    })
    .expect("a flat topology")
}

#[test]
fn shards_are_the_rings_segments() {
    assert_eq!(flat(3).shard_ranges(10), vec![0..3, 3..6, 6..10]);
    assert_eq!(lens(&flat(3).shard_ranges(2)), vec![0, 1, 1]);
    assert_eq!(flat(2).shard_ranges(0), vec![0..0, 0..0]);
    for total in 0..50 {
        for servers in 1..9 {
            let r = flat(servers).shard_ranges(total);
            let ring: Vec<_> = (0..servers)
                .map(|i| flotilla_group::segment(total, servers, i))
                .collect();
            assert_eq!(r, ring, "{total}/{servers}");
            assert_eq!(r.last().map(|x| x.end), Some(total));
            assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            let l = lens(&r);
            let (min, max) = (l.iter().min().copied(), l.iter().max().copied());
            assert!(max.zip(min).is_some_and(|(a, b)| a - b <= 1), "{l:?}");
        }
    }
}
