//! Model specs as graphs: a layer may keep its output under names (`out_variables`) and take
//! named outputs of earlier layers as extra inputs (`dependencies`), merged into its input by
//! `merge: add` (a residual connection, the default) or `merge: concat` (channels, or features
//! of a flat activation or of each position of a sequence). Layers stay in one order, so a name must be produced by an earlier
//! layer: a later one is a cycle, none at all a dangling name; both are errors that name it.
//!
//! In YAML a layer with links is a map with its layer key and the link keys:
//!
//! ```yaml
//! - conv2d: {out: 16, k: 3, padding: 1}
//!   out_variables: [block1]
//! - relu:
//!   dependencies: [block1]
//!   merge: add
//! ```

use std::collections::HashMap;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_norway::{Mapping, Value};

use crate::error::{EngineError, Result};
use crate::spec::layer::LayerSpec;
use crate::spec::shape::Shape;

/// How a layer's dependencies are combined with its input.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Merge {
    /// Element-wise sum; every shape must be equal (a residual connection).
    #[default]
    Add,
    /// Concatenation: on channels for images (equal height and width), on features for flat
    /// activations and for every position of sequences (of equal length).
    Concat,
}

/// One layer of a model and its named links.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// The layer.
    pub layer: LayerSpec,
    /// Names under which the layer's output is kept for later layers.
    pub out_variables: Vec<String>,
    /// Names of earlier outputs merged into this layer's input.
    pub dependencies: Vec<String>,
    /// How they are merged.
    pub merge: Merge,
}

impl From<LayerSpec> for Node {
    fn from(layer: LayerSpec) -> Self {
        Self {
            layer,
            out_variables: Vec::new(),
            dependencies: Vec::new(),
            merge: Merge::Add,
        }
    }
}

const LINK_KEYS: [&str; 3] = ["out_variables", "dependencies", "merge"];

/// Serializes a layer as a spec writes it: `relu`, or `{conv2d: {...}}`.
struct Written<'a>(&'a LayerSpec);

impl Serialize for Written<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        serde_norway::with::singleton_map::serialize(self.0, s)
    }
}

impl Serialize for Node {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let layer = serde_norway::to_value(Written(&self.layer)).map_err(S::Error::custom)?;
        if self.out_variables.is_empty() && self.dependencies.is_empty() {
            return layer.serialize(s);
        }
        let mut map = match layer {
            Value::Mapping(m) => m,
            Value::String(kind) => {
                let mut m = Mapping::new();
                m.insert(Value::String(kind), Value::Null);
                m
            }
            other => return Err(S::Error::custom(format!("unexpected layer form {other:?}"))),
        };
        let names = |v: &[String]| Value::Sequence(v.iter().cloned().map(Value::String).collect());
        if !self.out_variables.is_empty() {
            map.insert("out_variables".into(), names(&self.out_variables));
        }
        if !self.dependencies.is_empty() {
            map.insert("dependencies".into(), names(&self.dependencies));
            let merge = serde_norway::to_value(self.merge).map_err(S::Error::custom)?;
            map.insert("merge".into(), merge);
        }
        Value::Mapping(map).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        let mut map = match value {
            Value::String(_) => {
                let layer: LayerSpec = serde_norway::from_value(value).map_err(D::Error::custom)?;
                return Ok(Node::from(layer));
            }
            Value::Mapping(m) => m,
            other => {
                return Err(D::Error::custom(format!(
                    "a layer is a name (`- relu`) or a one-key map (`- linear: {{out: 10}}`), got {other:?}"
                )));
            }
        };
        let mut take = |key: &str| map.remove(key);
        let strings = |v: Option<Value>, key: &str| -> std::result::Result<Vec<String>, D::Error> {
            match v {
                None => Ok(Vec::new()),
                Some(v) => serde_norway::from_value(v)
                    .map_err(|e| D::Error::custom(format!("`{key}`: {e} (a list of names)"))),
            }
        };
        let out_variables = strings(take("out_variables"), "out_variables")?;
        let dependencies = strings(take("dependencies"), "dependencies")?;
        let merge = match take("merge") {
            None => Merge::Add,
            Some(v) => serde_norway::from_value(v)
                .map_err(|e| D::Error::custom(format!("`merge`: {e} (add or concat)")))?,
        };
        if map.len() != 1 {
            let keys: Vec<String> = map
                .keys()
                .map(|k| k.as_str().unwrap_or("?").to_string())
                .collect();
            return Err(D::Error::custom(format!(
                "a layer needs exactly one layer key besides {LINK_KEYS:?}, got {keys:?}"
            )));
        }
        let layer = match map.into_iter().next() {
            Some((kind, Value::Null)) => serde_norway::from_value(kind),
            Some((kind, params)) => {
                let mut one = Mapping::new();
                one.insert(kind, params);
                serde_norway::with::singleton_map::deserialize(Value::Mapping(one))
            }
            None => return Err(D::Error::custom("empty layer")),
        }
        .map_err(D::Error::custom)?;
        Ok(Node {
            layer,
            out_variables,
            dependencies,
            merge,
        })
    }
}

/// The input a layer sees after its dependencies are merged in, checking names and shapes.
/// `named` holds the shapes kept so far (by earlier layers' `out_variables`); `producers`
/// names, for every name of the model, the layer that keeps it (to tell a cycle from a
/// dangling name).
pub fn merged_input(
    index: usize,
    node: &Node,
    input: Shape,
    named: &HashMap<String, Shape>,
    producers: &HashMap<String, usize>,
) -> Result<Shape> {
    let err = |message: String| EngineError::LayerShape {
        index,
        kind: node.layer.kind().to_string(),
        message,
    };
    let mut shape = input;
    for name in &node.dependencies {
        let dep = match (named.get(name), producers.get(name)) {
            (Some(s), _) => *s,
            (None, Some(&later)) => {
                return Err(err(format!(
                    "depends on `{name}`, which layer {later} produces later: a cycle"
                )));
            }
            (None, None) => {
                return Err(err(format!(
                    "depends on `{name}`, which no layer produces (add `out_variables: [{name}]` to an earlier layer)"
                )));
            }
        };
        shape = match (node.merge, shape, dep) {
            (Merge::Add, a, b) if a == b => a,
            (Merge::Add, a, b) => {
                return Err(err(format!(
                    "adds `{name}` of shape {b} to an input of shape {a}: shapes must be equal"
                )));
            }
            (
                Merge::Concat,
                Shape::Image { c, h, w },
                Shape::Image {
                    c: c2,
                    h: h2,
                    w: w2,
                },
            ) if (h, w) == (h2, w2) => Shape::Image {
                c: c.saturating_add(c2),
                h,
                w,
            },
            (Merge::Concat, Shape::Flat(a), Shape::Flat(b)) => Shape::Flat(a.saturating_add(b)),
            (Merge::Concat, Shape::Seq { t, d }, Shape::Seq { t: t2, d: d2 }) if t == t2 => {
                Shape::Seq {
                    t,
                    d: d.saturating_add(d2),
                }
            }
            (Merge::Concat, a, b) => {
                return Err(err(format!(
                    "concatenates `{name}` of shape {b} to an input of shape {a}: images need equal height and width, sequences equal length, flat inputs concatenate with flat ones"
                )));
            }
        };
    }
    Ok(shape)
}

/// Which layer keeps each name; a name kept twice is an error naming both layers.
pub fn producers(nodes: &[Node]) -> Result<HashMap<String, usize>> {
    let mut out: HashMap<String, usize> = HashMap::new();
    for (i, node) in nodes.iter().enumerate() {
        for name in &node.out_variables {
            if let Some(first) = out.insert(name.clone(), i) {
                return Err(EngineError::LayerShape {
                    index: i,
                    kind: node.layer.kind().to_string(),
                    message: format!("keeps `{name}`, which layer {first} already keeps"),
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use crate::spec::{ModelSpec, Shape};

    fn spec(layers: &str) -> crate::Result<ModelSpec> {
        ModelSpec::from_yaml(&format!("input: [2, 8, 8]\nlayers:\n{layers}"), "t")
    }

    #[test]
    fn shipped_residual_models_parse_with_their_links() {
        let res = ModelSpec::builtin("resnet-mnist").expect("resnet-mnist");
        let linked = res
            .layers
            .iter()
            .filter(|n| !n.dependencies.is_empty())
            .count();
        assert!(linked >= 4, "{linked} residual merges");
        assert_eq!(res.output_shape().expect("out"), Shape::Flat(10));
        assert_eq!(res.classes().expect("classes"), 10);
        let mlp = ModelSpec::builtin("resmlp").expect("resmlp");
        assert_eq!(mlp.output_shape().expect("out"), Shape::Flat(10));
        // The canonical YAML (the config hash) keeps the links and reads back the same.
        for s in [res, mlp] {
            let again = ModelSpec::from_yaml(&s.to_yaml(), "again").expect("round trip");
            assert_eq!(again, s);
        }
    }

    #[test]
    fn dangling_cyclic_and_duplicate_names_are_named() {
        let e = spec("  - relu:\n    dependencies: [nope]\n  - flatten\n  - linear: {out: 2}\n")
            .expect_err("dangling")
            .to_string();
        assert!(
            e.contains("layer 0 (relu)") && e.contains("`nope`") && e.contains("no layer"),
            "{e}"
        );
        let e = spec("  - relu:\n    dependencies: [later]\n  - relu:\n    out_variables: [later]\n  - flatten\n  - linear: {out: 2}\n")
            .expect_err("cycle")
            .to_string();
        assert!(
            e.contains("`later`") && e.contains("layer 1") && e.contains("cycle"),
            "{e}"
        );
        let e = spec("  - relu:\n    out_variables: [x]\n  - tanh:\n    out_variables: [x]\n  - flatten\n  - linear: {out: 2}\n")
            .expect_err("duplicate")
            .to_string();
        assert!(e.contains("layer 1 (tanh)") && e.contains("layer 0"), "{e}");
    }

    #[test]
    fn merges_check_and_combine_shapes() {
        let concat = spec("  - relu:\n    out_variables: [x]\n  - conv2d: {out: 3, k: 3, padding: 1}\n  - identity:\n    dependencies: [x]\n    merge: concat\n  - flatten\n  - linear: {out: 2}\n")
            .expect("concat");
        let io = concat.infer_io().expect("io");
        assert_eq!(io[2].0, Shape::Image { c: 5, h: 8, w: 8 });
        let e = spec("  - relu:\n    out_variables: [x]\n  - conv2d: {out: 3, k: 3}\n  - identity:\n    dependencies: [x]\n  - flatten\n  - linear: {out: 2}\n")
            .expect_err("add of unequal shapes")
            .to_string();
        assert!(e.contains("[2, 8, 8]") && e.contains("[3, 6, 6]"), "{e}");
        let e = spec("  - relu:\n    merge: sideways\n  - flatten\n  - linear: {out: 2}\n")
            .expect_err("unknown merge")
            .to_string();
        assert!(e.contains("merge"), "{e}");
        let e = spec("  - relu:\n    tanh:\n  - flatten\n  - linear: {out: 2}\n")
            .expect_err("two layer keys")
            .to_string();
        assert!(e.contains("exactly one layer key"), "{e}");
    }
}
