//! The values table in `charts/gpupool/README.md` (what `helm show readme` prints) is generated
//! from `charts/gpupool/values.yaml`: each value, its default, and the comment above it. A value
//! added, removed, renamed or re-described in `values.yaml` without the README fails here, as
//! the CRD drift test does for the types. To rewrite the table:
//!
//! ```sh
//! charts/gpupool/gen-readme.sh    # GPUPOOL_WRITE_CHART_README=1 cargo test -p gpupool-crds --test chart_readme
//! ```

use std::path::{Path, PathBuf};

const BEGIN: &str =
    "<!-- values:begin: generated from values.yaml by gen-readme.sh; do not edit -->";
const END: &str = "<!-- values:end -->";

fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/gpupool")
}

/// One value of `values.yaml`: its dotted path, default as written, and the comment above it.
#[derive(Debug)]
struct Value {
    path: String,
    default: String,
    comment: Vec<String>,
    /// A key whose value is the block below it (a map), rather than a scalar or a list.
    map: bool,
    /// A key whose value is the list of items below it.
    list: bool,
}

/// Reads `values.yaml` line by line: indentation gives the path, the comment lines right above
/// a key describe it (a blank line ends a comment), list items below a key are its default.
fn parse(yaml: &str) -> Vec<Value> {
    let mut values: Vec<Value> = Vec::new();
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut comment: Vec<String> = Vec::new();
    let mut list_of: Option<usize> = None;
    for line in yaml.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() {
            comment.clear();
            continue;
        }
        if let Some(text) = trimmed.strip_prefix('#') {
            comment.push(text.strip_prefix(' ').unwrap_or(text).to_string());
            continue;
        }
        if let Some(item) = trimmed.strip_prefix("- ") {
            let owner = list_of.expect("a list item belongs to the key above it");
            let value = &mut values[owner];
            value.map = false;
            value.list = true;
            if !value.default.is_empty() {
                value.default.push_str(", ");
            }
            value.default.push_str(item.trim());
            comment.clear();
            continue;
        }
        let (key, rest) = trimmed
            .split_once(':')
            .unwrap_or_else(|| panic!("values.yaml: not a key: {line:?}"));
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        let path = stack
            .iter()
            .map(|(_, k)| k.as_str())
            .chain([key])
            .collect::<Vec<_>>()
            .join(".");
        let rest = rest.trim();
        values.push(Value {
            path,
            default: rest.to_string(),
            comment: std::mem::take(&mut comment),
            map: rest.is_empty(),
            list: false,
        });
        list_of = None;
        if rest.is_empty() {
            stack.push((indent, key.to_string()));
            list_of = Some(values.len() - 1);
        }
    }
    for value in values.iter_mut().filter(|v| v.list) {
        value.default = format!("[{}]", value.default);
    }
    values
}

/// The Markdown table: every scalar or list value, and every map that has a comment of its own.
fn table(values: &[Value]) -> String {
    // A table cell: `|` escaped, and `<` outside code spans written `&lt;` (else Markdown
    // takes `<kubeletDir>` for an HTML tag and shows nothing).
    let cell = |s: &str| {
        let mut out = String::new();
        let mut code = false;
        for c in s.chars() {
            match c {
                '`' => {
                    code = !code;
                    out.push(c);
                }
                '|' => out.push_str("\\|"),
                '<' if !code => out.push_str("&lt;"),
                _ => out.push(c),
            }
        }
        out
    };
    let mut out = String::from("| value | default | description |\n|---|---|---|\n");
    for value in values {
        if value.map && value.comment.is_empty() {
            continue;
        }
        let default = if value.map {
            "(below)".to_string()
        } else {
            format!("`{}`", cell(&value.default))
        };
        let comment = value
            .comment
            .iter()
            .map(|l| l.trim())
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        out.push_str(&format!(
            "| `{}` | {default} | {} |\n",
            value.path,
            cell(&comment)
        ));
    }
    out
}

#[test]
fn chart_readme_values_table_matches_values_yaml() {
    let dir = chart_dir();
    let values = std::fs::read_to_string(dir.join("values.yaml")).expect("values.yaml");
    let generated = table(&parse(&values));
    let readme_path = dir.join("README.md");
    let readme = std::fs::read_to_string(&readme_path).expect("charts/gpupool/README.md");
    let (head, rest) = readme
        .split_once(BEGIN)
        .unwrap_or_else(|| panic!("charts/gpupool/README.md lacks the line {BEGIN}"));
    let (current, tail) = rest
        .split_once(END)
        .unwrap_or_else(|| panic!("charts/gpupool/README.md lacks the line {END}"));
    let wanted = format!("\n{generated}");
    if current == wanted {
        return;
    }
    if std::env::var("GPUPOOL_WRITE_CHART_README").as_deref() == Ok("1") {
        std::fs::write(&readme_path, format!("{head}{BEGIN}{wanted}{END}{tail}"))
            .expect("write charts/gpupool/README.md");
        return;
    }
    panic!(
        "charts/gpupool/README.md's values table is not what values.yaml generates; run \
         charts/gpupool/gen-readme.sh and commit the result.\n--- generated ---\n{generated}"
    );
}

#[test]
fn the_table_has_every_value_with_its_comment() {
    let yaml = "# header\n\nop:\n  # How many.\n  # Two lines.\n  replicas: 2\n  image:\n    tag: \"\"\n\
                # Labels.\nlabels:\n  - {key: a, value: \"1\"}\n  - {key: b, value: \"2\"}\n";
    let values = parse(yaml);
    assert_eq!(
        table(&values),
        "| value | default | description |\n|---|---|---|\n\
         | `op.replicas` | `2` | How many. Two lines. |\n\
         | `op.image.tag` | `\"\"` |  |\n\
         | `labels` | `[{key: a, value: \"1\"}, {key: b, value: \"2\"}]` | Labels. |\n"
    );
}
