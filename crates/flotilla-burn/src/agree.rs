//! The check at start that every rank holds the same parameter list.
//!
//! Gradients are summed position by position in the flat order of the layout, so a rank whose
//! model has another tensor, shape or order would silently add unrelated numbers. Every rank
//! all-gathers each rank's list (names and shapes, a few bytes per tensor) and compares it with
//! rank 0's; all ranks reach the same verdict, so all of them fail together, naming each
//! differing rank and its first difference, as the config hash check does for `flotilla train`.

use flotilla_engine::ParamLayout;
use flotilla_group::ProcessGroup;

use crate::error::{DistError, Result};

/// One line per parameter tensor: `name [d0, d1, ...]`.
fn describe(layout: &ParamLayout) -> Vec<String> {
    layout
        .params
        .iter()
        .map(|p| format!("{} {:?}", p.name, p.shape))
        .collect()
}

/// Fails unless every rank of `group` has the parameter list of `layout`.
pub fn check_same_params(group: &dyn ProcessGroup, layout: &ParamLayout) -> Result<()> {
    let mine = describe(layout).join("\n");
    let all = group.all_gather_bytes(mine.as_bytes())?;
    let lists: Vec<Vec<String>> = all
        .iter()
        .map(|b| {
            String::from_utf8_lossy(b)
                .lines()
                .map(str::to_string)
                .collect()
        })
        .collect();
    let Some(reference) = lists.first() else {
        return Ok(());
    };
    let differences: Vec<String> = lists
        .iter()
        .enumerate()
        .skip(1)
        .filter_map(|(rank, list)| first_difference(reference, list).map(|d| (rank, d)))
        .map(|(rank, d)| format!("rank {rank} {d}"))
        .collect();
    if differences.is_empty() {
        Ok(())
    } else {
        Err(DistError::ModelsDiffer(differences.join("; ")))
    }
}

/// How `other` differs from `reference` first, or `None` if they are equal.
fn first_difference(reference: &[String], other: &[String]) -> Option<String> {
    let at = reference.iter().zip(other).position(|(a, b)| a != b);
    match at {
        Some(i) => Some(format!(
            "has `{}` where rank 0 has `{}` (parameter tensor {i})",
            other[i], reference[i]
        )),
        None if reference.len() != other.len() => Some(format!(
            "has {} parameter tensors where rank 0 has {}",
            other.len(),
            reference.len()
        )),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::first_difference;

    fn list(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn names_the_first_differing_tensor_or_the_count() {
        let a = list(&["fc1.weight [4, 8]", "fc1.bias [8]"]);
        assert_eq!(first_difference(&a, &a), None);
        let b = list(&["fc1.weight [4, 9]", "fc1.bias [8]"]);
        let d = first_difference(&a, &b).expect("differs");
        assert!(
            d.contains("`fc1.weight [4, 9]` where rank 0 has `fc1.weight [4, 8]`"),
            "{d}"
        );
        let c = list(&["fc1.weight [4, 8]"]);
        let d = first_difference(&a, &c).expect("differs");
        assert_eq!(d, "has 1 parameter tensors where rank 0 has 2");
    }
}
