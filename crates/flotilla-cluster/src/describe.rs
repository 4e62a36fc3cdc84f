//! Plain-text tables for [`crate::Topology::describe`] and [`crate::Placement::describe`].

/// Formats ascending ranks compactly: runs of consecutive ranks become `a-b`, others are
/// separated by commas; an empty list is `-`.
pub(crate) fn format_ranks(ranks: &[usize]) -> String {
    if ranks.is_empty() {
        return "-".to_owned();
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let start = ranks[i];
        let mut end = start;
        while i + 1 < ranks.len() && ranks[i + 1] == end + 1 {
            i += 1;
            end = ranks[i];
        }
        parts.push(if end == start {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

/// Left-aligned columns separated by two spaces, one line per row, header first.
pub(crate) fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (cell, w) in row.iter().zip(&widths) {
            line.push_str(&format!("{cell:<w$}  "));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_compressed_into_runs() {
        assert_eq!(format_ranks(&[]), "-");
        assert_eq!(format_ranks(&[0]), "0");
        assert_eq!(format_ranks(&[1, 4]), "1,4");
        assert_eq!(format_ranks(&[2, 3, 4, 5]), "2-5");
        assert_eq!(format_ranks(&[0, 1, 3, 5, 6, 7]), "0-1,3,5-7");
    }

    #[test]
    fn table_columns_are_aligned() {
        let rows = vec![
            vec!["0".to_owned(), "global server".to_owned()],
            vec!["10".to_owned(), "w".to_owned()],
        ];
        let t = render_table(&["rank", "role"], &rows);
        assert_eq!(t, "rank  role\n0     global server\n10    w\n");
    }
}
