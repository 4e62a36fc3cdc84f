//! "Did you mean": for a key the config does not have, the declared name nearest to it
//! ([`super::keys::KEYS`]), compared as `strsim`'s Jaro-Winkler similarity (what clap uses for
//! flags) of the names with `_`, `-` and `.` removed and in lower case, so `batchsize`,
//! `batch-size` and `BatchSize` all find `batch_size`.

use super::keys::KEYS;

/// The least similarity at which a name is suggested.
const SIMILAR: f64 = 0.85;

/// The error text for `key` at the top level of a source, which is no section and no flat
/// name: the nearest of those, or the sections when none is near.
pub(crate) fn unknown_top_level(key: &str) -> String {
    let flat = KEYS
        .iter()
        .flat_map(|k| k.aliases.iter().map(move |a| (*a, k.path)));
    let section_names = sections().into_iter().map(|s| (s, s));
    let paths = KEYS.iter().map(|k| (k.path, k.path));
    match nearest(key, flat.chain(section_names).chain(paths)) {
        Some((name, path)) if name == path => {
            format!("unknown key `{key}`; did you mean `{name}`?")
        }
        Some((name, path)) => format!("unknown key `{key}`; did you mean `{name}` ({path})?"),
        None => format!(
            "unknown key `{key}`: a top-level key is a section ({}) or the flat name of a key \
             (`lr`, `batch_size`, `epochs`, ...)",
            sections().join(", ")
        ),
    }
}

/// The error text for `field`, which section `section` does not have: the nearest of its
/// fields, or all of them.
pub(crate) fn unknown_field(section: &str, field: &str) -> String {
    let fields: Vec<&str> = KEYS
        .iter()
        .filter(|k| k.section() == section)
        .map(|k| k.field())
        .collect();
    match nearest(field, fields.iter().map(|f| (*f, *f))) {
        Some((name, _)) => {
            format!("unknown key `{section}.{field}`; did you mean `{section}.{name}`?")
        }
        None => format!(
            "unknown key `{section}.{field}`: `{section}` has {}",
            fields.join(", ")
        ),
    }
}

/// The sections, in the table's order.
fn sections() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for k in KEYS {
        if !out.contains(&k.section()) {
            out.push(k.section());
        }
    }
    out
}

/// The candidate (a name and what it stands for) most similar to `name`, if similar enough.
fn nearest<'a>(
    name: &str,
    candidates: impl Iterator<Item = (&'a str, &'a str)>,
) -> Option<(&'a str, &'a str)> {
    let plain = |s: &str| s.to_ascii_lowercase().replace(['_', '-', '.'], "");
    let wanted = plain(name);
    candidates
        .map(|c| (strsim::jaro_winkler(&wanted, &plain(c.0)), c))
        .filter(|(score, _)| *score >= SIMILAR)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_names_are_suggested_with_their_place() {
        let e = unknown_top_level("batchsize");
        assert!(e.contains("did you mean `batch_size`"), "{e}");
        assert!(e.contains("data.batch_size"), "{e}");
        let e = unknown_top_level("Max-Step");
        assert!(e.contains("did you mean `max_steps`"), "{e}");
        let e = unknown_top_level("telemetri");
        assert!(e.contains("did you mean `telemetry`?"), "{e}");
        let e = unknown_field("schedule", "epoch");
        assert!(e.contains("did you mean `schedule.epochs`?"), "{e}");
    }

    #[test]
    fn far_names_list_what_there_is() {
        let e = unknown_top_level("qqqqqq");
        assert!(!e.contains("did you mean"), "{e}");
        assert!(e.contains("schedule") && e.contains("optimizer"), "{e}");
        let e = unknown_field("comm", "zzzzzz");
        assert!(e.contains("master_port"), "{e}");
    }
}
