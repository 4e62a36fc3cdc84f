//! The staging layout of reduce-scatter and all-gather against serial sums, with NCCL's
//! collectives written out serially over the packed buffers (equal chunks, chunk `r` to
//! rank `r`): every rank's shard must hold the exact sum of every rank's values there, and
//! an all-gather must give every rank every shard, for lengths that do and do not divide.

use flotilla_group::shard;

use crate::ops::{pack_own, pack_shards, unpack};

/// Rank `r`'s buffer: distinct values per rank and position, exactly representable.
fn values(len: usize, r: usize) -> Vec<f32> {
    (0..len).map(|i| (r * 1000 + i) as f32 * 0.25).collect()
}

#[test]
fn reduce_scatter_leaves_each_rank_the_serial_sum_of_its_shard() {
    for (len, size) in [(10, 3), (9, 3), (1, 4), (0, 2), (17, 5), (8, 1)] {
        let packed: Vec<Vec<f32>> = (0..size)
            .map(|r| pack_shards(&values(len, r), size))
            .collect();
        let c = packed[0].len() / size;
        // ncclReduceScatter: rank r receives chunk r of the element-wise sum.
        let sum: Vec<f32> = (0..c * size)
            .map(|i| packed.iter().map(|p| p[i]).sum())
            .collect();
        for r in 0..size {
            let mut buf = values(len, r);
            unpack(&mut buf, &sum[r * c..(r + 1) * c], size, r..r + 1);
            let serial: Vec<f32> = (0..len)
                .map(|i| (0..size).map(|q| values(len, q)[i]).sum())
                .collect();
            let s = shard(len, size, r);
            assert_eq!(buf[s.clone()], serial[s], "len {len} size {size} rank {r}");
        }
    }
}

#[test]
fn all_gather_gives_every_rank_every_shard() {
    for (len, size) in [(10, 3), (9, 3), (1, 4), (17, 5), (8, 1)] {
        // The buffer every rank ends with: rank r's values in its shard.
        let mut expected = vec![0.0f32; len];
        for r in 0..size {
            let s = shard(len, size, r);
            expected[s.clone()].copy_from_slice(&values(len, r)[s]);
        }
        // ncclAllGather: every rank's chunk, in rank order.
        let gathered: Vec<f32> = (0..size)
            .flat_map(|r| pack_own(&values(len, r), (r, size)))
            .collect();
        for r in 0..size {
            let mut buf = values(len, r);
            unpack(&mut buf, &gathered, size, 0..size);
            assert_eq!(buf, expected, "len {len} size {size} rank {r}");
        }
    }
}
