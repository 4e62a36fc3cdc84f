//! The environment that gives another process the settings of a config: the inverse of
//! [`super::sources::Sources::env`], for a launcher that starts a program (which reads them
//! back with [`crate::program::settings`]).

use serde_json::Value;

use super::TrainConfig;
use super::keys::{KEYS, OPEN_SECTIONS, env_name};

impl TrainConfig {
    /// `(FLOTILLA_<SECTION>__<FIELD>, value)` for every declared key whose value is not its
    /// default (a number, a switch, a name or a path; a section such as `parameter_server`
    /// in YAML's flow style), leaving out the
    /// keys of `skip` (what the launcher passes in variables of its own: the world size and
    /// rendezvous address as torchrun's, the secret and TLS files as theirs).
    pub fn settings_env(&self, skip: &[&str]) -> Vec<(String, String)> {
        let ours = serde_json::to_value(self).unwrap_or_default();
        let defaults = serde_json::to_value(TrainConfig::default()).unwrap_or_default();
        let declared = KEYS
            .iter()
            .filter(|k| !OPEN_SECTIONS.contains(&k.section()))
            .map(|k| k.path.to_string());
        // An open section (the optimizer's fields depend on its kind) goes whole when it is
        // not the default's.
        let open = OPEN_SECTIONS
            .iter()
            .filter(|s| ours.get(**s) != defaults.get(**s))
            .flat_map(|s| {
                let fields = ours.get(*s).and_then(Value::as_object);
                fields
                    .into_iter()
                    .flat_map(move |o| o.keys().map(move |f| format!("{s}.{f}")))
            });
        declared
            .filter(|path| !skip.contains(&path.as_str()))
            .filter_map(|path| {
                let pointer = format!("/{}", path.replace('.', "/"));
                let value = ours.pointer(&pointer)?;
                if defaults.pointer(&pointer) == Some(value) {
                    return None;
                }
                Some((env_name(&path), value_text(value)?))
            })
            .chain(open.filter_map(|path| {
                let pointer = format!("/{}", path.replace('.', "/"));
                Some((env_name(&path), value_text(ours.pointer(&pointer)?)?))
            }))
            .collect()
    }
}

/// A value as a variable writes it: a scalar as its text, a list or a map as JSON (YAML's
/// flow style, which the environment's reader parses back); `None` for no value.
fn value_text(value: &Value) -> Option<String> {
    match value {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::sources::Sources;

    #[test]
    fn settings_sent_through_the_environment_read_back_the_same() {
        let text = "comm: {timeout_s: 7.5, transport: tcp, compression: lz4, chunk_kb: 128, \
                    insecure: true}\ndata: {batch_size: 32, path: data/x}\noptimizer: \
                    {name: sgd, lr: 0.25, momentum: 0.5}\nschedule: {epochs: 2}\n\
                    arch: hierarchical\nglobal_server: {aggr_type: sync, local_servers: \
                    [{aggr_type: async, num_workers: 2}, {aggr_type: sync, num_workers: 3}]}\n";
        let sent = TrainConfig::from_yaml(text, "job.yaml").expect("config");
        let env = sent.settings_env(&["comm.master_port"]);
        let names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        assert!(names.contains(&"FLOTILLA_COMM__TIMEOUT_S"), "{names:?}");
        assert!(names.contains(&"FLOTILLA_COMM__INSECURE"), "{names:?}");
        assert!(
            !names.contains(&"FLOTILLA_COMM__BUCKET_MB"),
            "a default is not sent"
        );
        let read = Sources::defaults()
            .env(env, false)
            .expect("env")
            .extract()
            .expect("read back");
        assert_eq!(read, sent);
    }
}
