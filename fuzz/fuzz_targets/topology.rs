//! The topology section parser and the rank assignment it leads to. Properties: garbage is an
//! error, never a panic; a valid spec gives a topology whose ranks are 0..world_size in order.
#![no_main]

use flotilla_cluster::{Arch, Topology, TopologySpec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let Ok(spec) = TopologySpec::from_yaml(&text, "fuzz.yaml") else {
        return;
    };
    if spec.validate().is_err() || matches!(spec.arch, Arch::Allreduce | Arch::Pipeline) {
        return;
    }
    let topology = Topology::build(&spec).expect("a valid spec builds");
    assert_eq!(topology.roles().len(), topology.world_size());
    for (rank, role) in topology.roles().iter().enumerate() {
        assert_eq!(role.rank, rank);
    }
});
