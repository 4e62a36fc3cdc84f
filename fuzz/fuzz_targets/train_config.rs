//! The training config parser: YAML text over the defaults, then environment variables
//! (the input after the first NUL byte, one `NAME=value` per line, with the launcher
//! variables), then extraction and validation. Properties: garbage is a config error, never a
//! panic; an extracted config serialised to YAML parses back to the same config; validation
//! (without the filesystem: inventory dropped, model a built-in spec) never panics.
#![no_main]

use flotilla_train::TrainConfig;
use flotilla_train::config::sources::Sources;
use libfuzzer_sys::fuzz_target;

fn env_vars(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (yaml, env) = text.split_once('\0').unwrap_or((text, ""));
    let Ok(sources) = Sources::defaults().yaml(yaml, "fuzz.yaml") else {
        return;
    };
    let Ok(sources) = sources.env(env_vars(env), true) else {
        return;
    };
    let Ok(mut config) = sources.extract() else {
        return;
    };
    let _ = sources.provenance();
    let written = serde_norway::to_string(&config).expect("a config serialises");
    let back = TrainConfig::from_yaml(&written, "written").expect("a written config parses");
    assert_eq!(
        serde_json::to_value(&back).expect("json"),
        serde_json::to_value(&config).expect("json"),
        "config does not survive YAML: {written}"
    );
    config.topology.inventory = None;
    if flotilla_engine::ModelSpec::builtin(&config.model.spec).is_none() {
        config.model.spec = "mlp".into();
    }
    let _ = config.validate();
});
