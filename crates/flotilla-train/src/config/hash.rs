//! What the ranks of a job must agree on: the config hash, and the per-rank paths it leaves
//! out.

use flotilla_engine::ModelSpec;

use super::TrainConfig;

/// Config paths that may differ between ranks (where a process runs and writes); everything
/// else must agree at rendezvous and enters [`TrainConfig::cluster_hash`].
pub const PER_RANK: &[&str] = &[
    "model.device",
    "data.path",
    "schedule.resume",
    "topology.inventory",
    "comm.master_addr",
    "comm.master_port",
    "comm.timeout_s",
    "comm.join_timeout_s",
    "comm.compression",
    "comm.secret_file",
    "comm.insecure",
    "comm.shm_dir",
    "comm.max_queued_mb",
    "comm.socket_buffer_kb",
    "comm.threads",
    "comm.tls",
    "comm.auto_tls",
    "telemetry",
];

impl TrainConfig {
    /// A hash of everything all ranks must agree on: the whole config except the
    /// [`PER_RANK`] paths, with the model spec resolved (a file path and the built-in name of
    /// the same model hash alike; two different files of the same name do not).
    pub fn cluster_hash(&self, spec: &ModelSpec) -> u64 {
        self.shared_hash(Some(&spec.to_yaml()))
    }

    /// A hash of the whole config except the [`PER_RANK`] paths, with `model` (the model's
    /// fingerprint: a spec's canonical text, a module's parameter shapes) in place of
    /// `model.spec` when given (a program that only joins a group gives none).
    pub fn shared_hash(&self, model: Option<&str>) -> u64 {
        let mut shared = serde_json::to_value(self).unwrap_or_default();
        for path in PER_RANK {
            remove_path(&mut shared, path);
        }
        if let Some(model) = model
            && let Some(m) = shared.get_mut("model").and_then(|m| m.as_object_mut())
        {
            m.insert("spec".into(), serde_json::Value::String(model.to_string()));
        }
        xxhash_rust::xxh3::xxh3_64(shared.to_string().as_bytes())
    }
}

/// Removes `a.b.c` from a JSON tree, if present.
fn remove_path(v: &mut serde_json::Value, path: &str) {
    let mut parts: Vec<&str> = path.split('.').collect();
    let Some(last) = parts.pop() else { return };
    let mut cur = v;
    for p in parts {
        match cur.get_mut(p) {
            Some(next) => cur = next,
            None => return,
        }
    }
    if let Some(m) = cur.as_object_mut() {
        m.remove(last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TlsSetting;
    use flotilla_tcp::WireFormat;

    #[test]
    fn cluster_hash_ignores_per_rank_settings() {
        let a = TrainConfig::default();
        let spec = a.validate().expect("valid");
        let mut b = a.clone();
        b.telemetry.output = "elsewhere".into();
        b.data.path = "other".into();
        b.comm.master_port = 1234;
        b.comm.timeout_s = 5.0;
        b.comm.secret_file = Some("/etc/flotilla/secret".into());
        b.comm.insecure = true;
        b.comm.tls = Some(TlsSetting {
            ca: "/etc/flotilla/ca.pem".into(),
            cert: "/etc/flotilla/node1.pem".into(),
            key: "/etc/flotilla/node1.key".into(),
        });
        b.schedule.resume = true;
        assert_eq!(a.cluster_hash(&spec), b.cluster_hash(&spec));
        // Every shared section counts, including fields added later (no list to forget).
        for change in [
            |c: &mut TrainConfig| c.data.batch_size = 32,
            |c: &mut TrainConfig| c.schedule.warmup_steps = 1,
            |c: &mut TrainConfig| c.comm.bucket_mb = 1.0,
            |c: &mut TrainConfig| c.comm.wire_format = WireFormat::Bf16,
            |c: &mut TrainConfig| c.comm.small_all_reduce_kb = 0,
            |c: &mut TrainConfig| c.comm.mid_all_reduce_kb = 0,
            |c: &mut TrainConfig| c.comm.chunk_kb = 64,
            |c: &mut TrainConfig| c.comm.shm_chunk_kb = 64,
            |c: &mut TrainConfig| c.topology.local_steps = 2,
            |c: &mut TrainConfig| c.model.seed = 1,
        ] {
            let mut d = a.clone();
            change(&mut d);
            assert_ne!(a.cluster_hash(&spec), d.cluster_hash(&spec), "{d:?}");
        }
    }
}
