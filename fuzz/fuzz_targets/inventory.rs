//! The inventory parser (host lists and Ansible-style INI). Properties: garbage is an error
//! naming the source, never a panic; every parsed host has a non-empty name and address.
#![no_main]

use flotilla_cluster::Inventory;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match Inventory::parse(&text, "fuzz.ini") {
        Ok(inv) => {
            for h in inv.hosts() {
                assert!(!h.name().is_empty(), "a host without a name");
                assert!(!h.address().is_empty(), "a host without an address");
                let _ = h.inline_port();
            }
        }
        Err(e) => assert!(e.to_string().contains("fuzz.ini"), "{e}"),
    }
});
