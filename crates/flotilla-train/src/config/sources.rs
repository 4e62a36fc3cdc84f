//! One mechanism for building a [`TrainConfig`]: its sources merged in order, later ones
//! winning key by key — defaults < config file < environment < command-line flags — with every
//! value's source remembered ([`Sources::provenance`], printed by `flotilla config`).
//!
//! Merging and provenance are [`figment`]'s; this module adds what is Flotilla's own, with
//! the names of [`keys::KEYS`] (the one declaration of every key):
//! - **aliases**: the flat keys of earlier versions and of hcddl (`lr`, `batch_size`,
//!   `arch`, `num_server_rounds`, `model: lenet5`, ...) are rewritten to their place in the
//!   sections before merging, so there is one place per value (a file's `lr:` *is*
//!   `optimizer.lr`, and `--lr` beats it like any flag beats any file value). A source that
//!   sets a value both ways is an error naming both;
//! - **optimizer replacement**: a source that names an optimizer (`optimizer.name`)
//!   replaces the optimizer of the sources below instead of merging into it (Adam has no
//!   momentum);
//! - **environment**: `FLOTILLA_<SECTION>__<KEY>` (e.g. `FLOTILLA_OPTIMIZER__LR=0.05`) or a
//!   flat alias (`FLOTILLA_BATCH_SIZE=32`); and, for processes started by a launcher,
//!   world size and rendezvous of torchrun, Open MPI, MPICH, Slurm (the first host of
//!   `SLURM_JOB_NODELIST`) and Kubernetes, read in the order of
//!   [`flotilla_cluster::launcher_env`], under the `FLOTILLA_` variables;
//! - **flags**: one source per flag given ([`Sources::flag`]), setting the key the flag is
//!   declared for.

use std::path::Path;

use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use serde_json::Value;

use super::TrainConfig;
use super::{keys, suggest};
use crate::error::{Result, TrainError};

/// One source: a nested tree of values and the name of where it came from.
#[derive(Debug, Clone)]
struct Source {
    name: String,
    tree: serde_json::Map<String, Value>,
}

impl Provider for Source {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name.clone())
    }

    fn data(&self) -> std::result::Result<Map<Profile, Dict>, figment::Error> {
        figment::providers::Serialized::defaults(&self.tree).data()
    }
}

/// Where each value of an effective config came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Provenance {
    /// Dotted path (`optimizer.lr`).
    pub path: String,
    /// The value, as JSON text.
    pub value: String,
    /// The source that set it (`default`, `file run.yaml`, `env FLOTILLA_SEED`, `flag --lr`).
    pub source: String,
}

/// A config's sources, lowest first.
#[derive(Debug, Clone)]
pub struct Sources {
    sources: Vec<Source>,
}

fn err(source: &str, msg: impl Into<String>) -> TrainError {
    TrainError::config(source, msg.into())
}

impl Sources {
    /// Just the defaults.
    pub fn defaults() -> Self {
        let tree = match serde_json::to_value(TrainConfig::default()) {
            Ok(Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        };
        Self {
            sources: vec![Source {
                name: "default".into(),
                tree,
            }],
        }
    }

    /// Adds a source of YAML text (`source` names it).
    pub fn yaml(self, text: &str, source: &str) -> Result<Self> {
        if text.trim().is_empty() {
            return Ok(self);
        }
        let source = format!("file {source}");
        let v = parse_yaml(text).map_err(|e| err(&source, e))?;
        let v = match v {
            Value::Null => return Ok(self),
            v => v,
        };
        self.tree(v, &source)
    }

    /// Adds a config file.
    pub fn file(self, path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
        self.yaml(&text, &path.display().to_string())
    }

    /// Adds a source given as a tree of flat aliases and/or sections (`source` names it).
    fn tree(mut self, v: Value, source: &str) -> Result<Self> {
        let tree = normalize(v, source)?;
        if !tree.is_empty() {
            self.sources.push(Source {
                name: source.to_string(),
                tree,
            });
        }
        Ok(self)
    }

    /// Adds the source of one flag: `--<long>` with its value, which sets the key it is
    /// declared for ([`keys::by_flag`]).
    pub fn flag(mut self, long: &str, value: Value) -> Result<Self> {
        let name = format!("flag --{long}");
        let key = keys::by_flag(long).ok_or_else(|| err(&name, "no such flag"))?;
        let mut tree = serde_json::Map::new();
        set(&mut tree, key.path, value, &name)?;
        self.sources.push(Source { name, tree });
        Ok(self)
    }

    /// One source per value a launcher's variables set (world size, rendezvous host and
    /// port; see [`flotilla_cluster::launcher_env`] for which variables, in which order).
    fn launcher_sources(&mut self, vars: &[(String, String)]) -> Result<()> {
        let map: std::collections::HashMap<&str, &str> =
            vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let e = flotilla_cluster::LauncherEnv::read(&|k| map.get(k).map(|v| v.to_string()))
            .map_err(|e| err("environment", e.to_string()))?;
        let found = [
            e.world_size
                .map(|v| ("topology.world_size", Value::from(v.value), v.var)),
            e.master_addr
                .map(|v| ("comm.master_addr", Value::from(v.value), v.var)),
            e.master_port
                .map(|v| ("comm.master_port", Value::from(v.value), v.var)),
        ];
        for (path, value, var) in found.into_iter().flatten() {
            let source = format!("env {var}");
            let mut tree = serde_json::Map::new();
            set(&mut tree, path, value, &source)?;
            self.sources.push(Source { name: source, tree });
        }
        Ok(())
    }

    /// Adds one source per setting the environment makes: `FLOTILLA_...` variables, and with
    /// `launcher` the launcher variables (world size, rendezvous address and port).
    pub fn env(
        mut self,
        vars: impl IntoIterator<Item = (String, String)>,
        launcher: bool,
    ) -> Result<Self> {
        let mut vars: Vec<(String, String)> = vars
            .into_iter()
            .filter(|(_, v)| !v.trim().is_empty())
            .collect();
        vars.sort();
        if launcher {
            // Under the FLOTILLA_ variables, which are read after them and so win.
            self.launcher_sources(&vars)?;
        }
        for (name, raw) in vars {
            let source = format!("env {name}");
            let value = scalar(&raw).map_err(|e| err(&source, e))?;
            let path = if let Some(key) = name.strip_prefix("FLOTILLA_") {
                let key = key.to_ascii_lowercase();
                if key.contains("__") {
                    let path = key.replace("__", ".");
                    if !known_path(&path) {
                        return Err(err(&source, format!("no config key `{path}`")));
                    }
                    path
                } else if keys::by_alias(&key).is_some() {
                    // A flat key, rewritten as in a file (one may set two paths).
                    let one = serde_json::Map::from_iter([(key, value)]);
                    let tree = normalize(Value::Object(one), &source)?;
                    self.sources.push(Source { name: source, tree });
                    continue;
                } else if let Some(why) = super::retired::replacement(&name) {
                    return Err(err(&source, why));
                } else {
                    // Other FLOTILLA_ variables belong to other parts (the secret, fault tests).
                    continue;
                }
            } else {
                continue;
            };
            let mut tree = serde_json::Map::new();
            set(&mut tree, &path, value, &source)?;
            self.sources.push(Source { name: source, tree });
        }
        Ok(self)
    }

    /// The merged figment: a layer (the file, the environment, the flags) that names an
    /// optimizer replaces the optimizer of the layers below it; the sources of that layer
    /// (`FLOTILLA_OPTIMIZER__NAME` and `FLOTILLA_OPTIMIZER__MOMENTUM`) make one optimizer.
    fn figment(&self) -> Figment {
        let layer = |s: &Source| s.name.split(' ').next().unwrap_or_default().to_string();
        let last_named = self.sources.iter().rposition(|l| {
            l.tree
                .get("optimizer")
                .and_then(|o| o.get("name"))
                .is_some()
        });
        let first_of_layer = last_named.map(|n| {
            let named = layer(&self.sources[n]);
            self.sources[..n]
                .iter()
                .rposition(|s| layer(s) != named)
                .map_or(0, |p| p + 1)
        });
        let mut f = Figment::new();
        for (i, source) in self.sources.iter().enumerate() {
            let mut source = source.clone();
            if first_of_layer.is_some_and(|n| i < n) {
                source.tree.remove("optimizer");
            }
            self.choose_stages_once(i, &mut source);
            f = f.merge(source);
        }
        f
    }

    /// `pipeline.stages` and `pipeline.split_points` are one setting, how the stages are
    /// chosen: the last source that gives either drops the other from `source` (the `i`-th)
    /// when it comes before it, so `--stages 3` replaces a file's `split_points`.
    fn choose_stages_once(&self, i: usize, source: &mut Source) {
        const KEYS: [&str; 2] = ["stages", "split_points"];
        let gives = |s: &Source, k: &str| s.tree.get("pipeline").and_then(|p| p.get(k)).is_some();
        let last = (self.sources.iter()).rposition(|s| KEYS.iter().any(|k| gives(s, k)));
        let Some(last) = last.filter(|&n| i < n) else {
            return;
        };
        if let Some(serde_json::Value::Object(p)) = source.tree.get_mut("pipeline") {
            for k in KEYS.iter().filter(|k| !gives(&self.sources[last], k)) {
                p.remove(*k);
            }
        }
    }

    /// The effective config.
    pub fn extract(&self) -> Result<TrainConfig> {
        self.figment().extract().map_err(|e| {
            let source = e
                .metadata
                .as_ref()
                .map_or_else(|| "config".to_string(), |m| m.name.to_string());
            let path = e.path.join(".");
            let mut kind = e.kind.to_string();
            if !path.is_empty() {
                kind = format!("`{path}`: {kind}");
            }
            err(&source, kind)
        })
    }

    /// Every leaf of the effective config with the source that set it.
    pub fn provenance(&self) -> Result<Vec<Provenance>> {
        let config = self.extract()?;
        let f = self.figment();
        let tree = serde_json::to_value(&config).unwrap_or_default();
        let mut out = Vec::new();
        leaves(&tree, String::new(), &mut |path, value| {
            let source = f
                .find_value(&path)
                .ok()
                .and_then(|v| f.get_metadata(v.tag()).map(|m| m.name.to_string()))
                .unwrap_or_else(|| "default".into());
            out.push(Provenance {
                path,
                value: value.to_string(),
                source,
            });
        });
        Ok(out)
    }
}

impl TrainConfig {
    /// Parses a config from YAML text over the defaults; `source_name` names it in errors.
    pub fn from_yaml(text: &str, source_name: &str) -> Result<Self> {
        Sources::defaults().yaml(text, source_name)?.extract()
    }

    /// Reads a config file over the defaults. Relative `data`, `output` and `model` paths
    /// stay relative to the working directory, as with every command-line tool.
    pub fn load(path: &Path) -> Result<Self> {
        Sources::defaults().file(path)?.extract()
    }
}

/// A number as a setting: finite. `nan` and `inf` parse as `f64` but set nothing a run can
/// use, and the JSON that carries every source to the config has no such numbers (they
/// would arrive as null: "invalid type: found unit"). The command line's floating-point
/// flags parse with it too.
pub fn finite_number(raw: &str) -> std::result::Result<f64, String> {
    match raw.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err(format!("{raw} is not a finite number")),
        Err(_) => Err(format!("{raw} is not a number (e.g. 0.05 or 1e-3)")),
    }
}

/// Parses YAML text, refusing a number that is not finite (`.nan`, `.inf`) by its key.
fn parse_yaml(text: &str) -> std::result::Result<Value, String> {
    let v: serde_norway::Value = serde_norway::from_str(text).map_err(|e| e.to_string())?;
    non_finite_at(&v, "")?;
    serde_json::to_value(v).map_err(|e| e.to_string())
}

/// Fails naming the first key under `at` whose value is a number that is not finite.
fn non_finite_at(v: &serde_norway::Value, at: &str) -> std::result::Result<(), String> {
    match v {
        serde_norway::Value::Number(n) if n.is_nan() || n.is_infinite() => Err(format!(
            "`{at}`: {} is not a finite number",
            serde_norway::to_string(n).unwrap_or_default().trim()
        )),
        serde_norway::Value::Mapping(m) => m.iter().try_for_each(|(k, v)| {
            let k = k.as_str().map_or_else(|| format!("{k:?}"), str::to_owned);
            let path = if at.is_empty() {
                k
            } else {
                format!("{at}.{k}")
            };
            non_finite_at(v, &path)
        }),
        serde_norway::Value::Sequence(items) => items.iter().try_for_each(|v| non_finite_at(v, at)),
        _ => Ok(()),
    }
}

/// Parses an environment value as a YAML scalar (numbers, booleans), else a string; a
/// number that is not finite (`nan`, `.inf`) is refused ([`finite_number`]).
fn scalar(raw: &str) -> std::result::Result<Value, String> {
    if raw.trim().parse::<f64>().is_ok() {
        finite_number(raw)?;
    }
    match serde_norway::from_str::<serde_norway::Value>(raw) {
        Ok(serde_norway::Value::Number(n)) if n.is_nan() || n.is_infinite() => {
            Err(format!("{raw} is not a finite number"))
        }
        Ok(v @ (serde_norway::Value::Number(_) | serde_norway::Value::Bool(_))) => {
            serde_json::to_value(v).map_err(|e| e.to_string())
        }
        // A section or list written in YAML's flow style (`{aggr_type: sync, num_workers:
        // 2}`, as a launcher passes `parameter_server`); other text is a name or a path.
        Ok(v @ (serde_norway::Value::Mapping(_) | serde_norway::Value::Sequence(_)))
            if raw.trim_start().starts_with(['{', '[']) =>
        {
            serde_json::to_value(v).map_err(|e| e.to_string())
        }
        _ => Ok(Value::String(raw.to_string())),
    }
}

/// Whether `a.b` names a key of the config (a declared one, or any key of the optimizer,
/// whose keys depend on its kind and which serde checks); further parts are serde's to check.
fn known_path(path: &str) -> bool {
    let mut parts = path.split('.');
    match (parts.next(), parts.next()) {
        (Some(section), None) => keys::is_section(section),
        (Some(section), Some(field)) => keys::is_key(section, field),
        (None, _) => false,
    }
}

/// Rewrites flat aliases into sections; a value set twice in one source is an error.
fn normalize(v: Value, source: &str) -> Result<serde_json::Map<String, Value>> {
    let Value::Object(top) = v else {
        return Err(err(source, "the top level must be a mapping of keys"));
    };
    let mut out = serde_json::Map::new();
    for (key, value) in top {
        let is_section = keys::is_section(&key) && value.is_object();
        if is_section {
            let Value::Object(fields) = value else {
                continue;
            };
            for (field, v) in fields {
                if !keys::is_key(&key, &field) {
                    return Err(err(source, suggest::unknown_field(&key, &field)));
                }
                set(&mut out, &format!("{key}.{field}"), v, source)?;
            }
        } else if let Some(k) = keys::by_alias(&key) {
            set(&mut out, k.path, value, source)?;
        } else {
            return Err(err(source, suggest::unknown_top_level(&key)));
        }
    }
    Ok(out)
}

/// The all-reduce mode a `topology.arch` (`strategy`, `arch`) of `sync_allreduce` or
/// `async_allreduce` names.
fn allreduce_strategy(path: &str, value: &Value) -> Option<&'static str> {
    if path != "topology.arch" {
        return None;
    }
    match value.as_str()? {
        "sync_allreduce" => Some("sync"),
        "async_allreduce" => Some("async"),
        _ => None,
    }
}

/// Sets `section.key` in a tree; an error if the source already set it. `strategy:
/// async_allreduce` (from any source) is the all-reduce architecture in async mode.
fn set(
    tree: &mut serde_json::Map<String, Value>,
    path: &str,
    value: Value,
    source: &str,
) -> Result<()> {
    if let Some(mode) = allreduce_strategy(path, &value) {
        set(tree, path, Value::from("allreduce"), source)?;
        return set(tree, "allreduce.mode", Value::from(mode), source);
    }
    let (section, key) = path.split_once('.').unwrap_or((path, ""));
    let entry = tree
        .entry(section.to_string())
        .or_insert_with(|| Value::Object(serde_json::Map::new()));
    let Value::Object(m) = entry else {
        return Err(err(source, format!("`{section}` must be a mapping")));
    };
    if m.contains_key(key) {
        return Err(err(
            source,
            format!(
                "`{path}` is set twice (a flat key and its section, e.g. `lr` and `optimizer.lr`)"
            ),
        ));
    }
    m.insert(key.to_string(), value);
    Ok(())
}

fn leaves(v: &Value, prefix: String, f: &mut dyn FnMut(String, &Value)) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, child) in m {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(child, path, f);
            }
        }
        _ => f(prefix, v),
    }
}

// In a file of its own beside this one (the path is relative to this file's directory).
#[cfg(test)]
#[path = "sources_tests.rs"]
mod tests;
