//! The async all-reduce cycle's announcement decoder. Properties: garbage is an error, never
//! a panic, and no allocation beyond the input's size; a decoded announcement survives
//! encode → decode; an arbitrary announcement survives encode → decode.
#![no_main]

use flotilla_train::strategy::allreduce::cycle::negotiate::Announce;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

fn announce_from(u: &mut Unstructured<'_>) -> Result<Announce> {
    let words = u.int_in_range(0..=8)?;
    let names = u.int_in_range(0..=4)?;
    Ok(Announce {
        stop: u.arbitrary()?,
        abort: u.arbitrary()?,
        ready: (0..words).map(|_| u.arbitrary()).collect::<Result<_>>()?,
        new_names: (0..names)
            .map(|_| Ok((u.arbitrary::<String>()?, u.arbitrary::<u64>()?)))
            .collect::<Result<_>>()?,
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(a) = Announce::decode(data) {
        assert_eq!(Announce::decode(&a.encode()).as_ref(), Ok(&a));
    }
    if let Ok(a) = announce_from(&mut Unstructured::new(data)) {
        assert_eq!(Announce::decode(&a.encode()), Ok(a));
    }
});
