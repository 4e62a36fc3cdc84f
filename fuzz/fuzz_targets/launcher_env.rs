//! The launcher-variable reader (torchrun, MPI, Slurm, Kubernetes): `NAME=value` lines.
//! Properties: never a panic; a bad value is an error naming its variable; the first host of
//! a Slurm node list is non-empty and has no comma.
#![no_main]

use std::collections::HashMap;

use flotilla_cluster::LauncherEnv;
use flotilla_cluster::launcher_env::first_host;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let vars: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let _ = LauncherEnv::read(&|k| vars.get(k).map(|v| v.to_string()));
    if let Some(host) = first_host(&text) {
        assert!(
            !host.is_empty() && !host.contains(','),
            "{text:?} -> {host:?}"
        );
    }
});
