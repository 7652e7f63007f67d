//! The docs are tested like the code (issue #40): every relative link and `#anchor` in the
//! README, `docs/` and the chart's README resolves; every `examples/*.yaml` they name exists
//! (`e2e/tests/api.rs` applies each of those to the real apiserver); the Quickstart's commands
//! exist; every figure the README and the chart's `values.yaml` comments state is on the
//! benchmarks page, and each row of the README's goal table quotes that goal's row there
//! (target, figures, verdict, command), so each figure has one source.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `README.md`, every Markdown file under `docs/`, and the chart's README.
fn doc_files() -> Vec<PathBuf> {
    let root = repo_root();
    let mut files = vec![
        root.join("README.md"),
        root.join("charts/gpupool/README.md"),
    ];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("docs/ is readable") {
            let path = entry.expect("a docs/ entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The lines of a Markdown text outside fenced code blocks, with their 1-based numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            lines.push((i + 1, line));
        }
    }
    lines
}

/// GitHub's anchor for a heading: lowercase, punctuation dropped (letters, digits, `-`, `_`
/// and spaces kept), each space a `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a Markdown file has: its headings' slugs, a repeated one numbered `-1`, `-2`…
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for (_, line) in prose(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim_end_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The targets of the Markdown links (and images) on a line: what follows `](` up to `)`.
fn link_targets(line: &str) -> Vec<&str> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        if let Some(end) = rest.find(')') {
            targets.push(rest[..end].trim());
            rest = &rest[end..];
        }
    }
    targets
}

fn relative(path: &Path) -> String {
    path.strip_prefix(repo_root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Every broken relative link or anchor in `file`, as "file:line: why".
fn broken_links(file: &Path) -> Vec<String> {
    let text = read(file);
    let own_anchors = anchors(&text);
    let mut broken = Vec::new();
    for (number, line) in prose(&text) {
        for target in link_targets(line) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target, None),
            };
            let at = format!("{}:{number}: ({target})", relative(file));
            let resolved = if path.is_empty() {
                file.to_path_buf()
            } else {
                file.parent().expect("a file's directory").join(path)
            };
            if !resolved.exists() {
                broken.push(format!("{at}: {} does not exist", resolved.display()));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            let known = if path.is_empty() {
                own_anchors.clone()
            } else if resolved.extension().is_some_and(|e| e == "md") {
                anchors(&read(&resolved))
            } else {
                broken.push(format!("{at}: an anchor into a file that is not Markdown"));
                continue;
            };
            if !known.contains(anchor) {
                broken.push(format!("{at}: no heading makes the anchor #{anchor}"));
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let files = doc_files();
    assert!(
        files.len() >= 8,
        "README, the chart's README and docs/: {files:?}"
    );
    let broken: Vec<String> = files.iter().flat_map(|f| broken_links(f)).collect();
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_checker_catches_a_broken_anchor_and_file() {
    let dir = std::env::temp_dir().join(format!("gpupool-docs-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("page.md");
    std::fs::write(
        &page,
        "# A page: its title\n\n## Sharing GPUs: time-slicing and MPS, and what each isolates\n\n\
         [ok](#sharing-gpus-time-slicing-and-mps-and-what-each-isolates) [ok](#a-page-its-title)\n\
         [bad](#sharing-gpus) [gone](missing.md) [ok](page.md#a-page-its-title)\n\
         ```\n[in code](nowhere.md)\n```\n",
    )
    .unwrap();
    let broken = broken_links(&page);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(broken.len(), 2, "{broken:#?}");
    assert!(broken[0].contains("#sharing-gpus") && broken[1].contains("missing.md"));
}

/// Every `examples/<name>.yaml` a text names.
fn examples_named(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("examples/") {
        rest = &rest[at + "examples/".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            .collect();
        // A sentence's full stop may follow the name: cut at the extension.
        if let Some(end) = name.find(".yaml") {
            names.insert(format!("examples/{}.yaml", &name[..end]));
        }
    }
    names
}

/// Every example the docs name; `e2e/tests/api.rs` checks each is applied to the apiserver.
fn examples_the_docs_name() -> BTreeSet<String> {
    doc_files()
        .iter()
        .flat_map(|f| examples_named(&read(f)))
        .collect()
}

#[test]
fn example_names_are_read_up_to_their_extension() {
    let names = examples_named("see examples/a-pool.yaml. Or [b](examples/b_pool.yaml), examples/");
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["examples/a-pool.yaml", "examples/b_pool.yaml"]
    );
}

#[test]
fn every_example_the_docs_name_exists() {
    let root = repo_root();
    let named = examples_the_docs_name();
    assert!(
        named.contains("examples/minimal-pool.yaml"),
        "the README's minimal pool: {named:?}"
    );
    let missing: Vec<_> = named.iter().filter(|n| !root.join(n).is_file()).collect();
    assert!(
        missing.is_empty(),
        "named in the docs, not in the repository: {missing:?}"
    );
}

#[test]
fn the_quickstart_commands_exist_and_ci_runs_the_test_command() {
    let root = repo_root();
    let readme = read(&root.join("README.md"));
    let section = readme
        .split("\n## Quickstart\n")
        .nth(1)
        .expect("the README has a Quickstart");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the Quickstart opens with a sh block");
    let commands: Vec<&str> = block
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        commands,
        ["./demo.sh", "./test.sh"],
        "the two Quickstart commands"
    );
    for command in &commands {
        let path = root.join(command);
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{command}: {e}"))
            .permissions();
        use std::os::unix::fs::PermissionsExt;
        assert!(mode.mode() & 0o111 != 0, "{command} is not executable");
    }
    let ci = read(&root.join(".ci/run"));
    assert!(
        ci.contains("./test.sh"),
        ".ci/run runs the README's test command"
    );
}

/// The figures a text states: a number with a unit of memory, time below a second, or a ratio
/// (`1.88 ms`, `61.0 MiB`, `6.52×`, `6.18–14.07 ms`), written without the space.
fn figures(text: &str) -> BTreeSet<String> {
    const UNITS: [&str; 6] = ["MiB", "KiB", "GiB", "ms", "µs", "×"];
    let chars: Vec<char> = text.chars().collect();
    let mut found = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let starts = chars[i].is_ascii_digit()
            && (i == 0 || !(chars[i - 1].is_alphanumeric() || matches!(chars[i - 1], '.' | '–')));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len() && (chars[j].is_ascii_digit() || matches!(chars[j], '.' | ',' | '–'))
        {
            j += 1;
        }
        let number: String = chars[i..j].iter().collect();
        let number = number.trim_end_matches(['.', ',', '–']);
        let mut k = j;
        if k < chars.len() && chars[k] == ' ' {
            k += 1;
        }
        let after: String = chars[k..chars.len().min(k + 3)].iter().collect();
        if let Some(unit) = UNITS.iter().find(|u| after.starts_with(**u)) {
            let next = chars.get(k + unit.chars().count());
            if !next.is_some_and(|c| c.is_alphanumeric()) {
                found.insert(format!("{number}{unit}"));
            }
        }
        i = j.max(i + 1);
    }
    found
}

#[test]
fn every_figure_the_readme_and_the_chart_values_state_is_on_the_benchmarks_page() {
    let root = repo_root();
    let benchmarks = figures(&read(&root.join("docs/benchmarks.md")));
    let readme = figures(&read(&root.join("README.md")));
    assert!(
        readme.contains("62.0MiB") && readme.contains("1.31×"),
        "the README quotes the goals' figures: {readme:?}"
    );
    let values_comments: String = read(&root.join("charts/gpupool/values.yaml"))
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix('#'))
        .collect::<Vec<_>>()
        .join("\n");
    for (source, stated) in [
        ("README.md", readme),
        (
            "charts/gpupool/values.yaml (comments)",
            figures(&values_comments),
        ),
    ] {
        let elsewhere: Vec<_> = stated.difference(&benchmarks).collect();
        assert!(
            elsewhere.is_empty(),
            "{source} states figures docs/benchmarks.md does not (state each once, there, and \
             quote it): {elsewhere:?}"
        );
    }
}

#[test]
fn figures_are_read_with_their_units() {
    let found =
        figures("1.88 ms (1.85–1.89), 6.52× and 6.18–14.07 ms; H100 x4 ≤ 64 MiB, 10,000 calls");
    let expected: BTreeSet<String> = ["1.88ms", "6.52×", "6.18–14.07ms", "64MiB"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(found, expected);
}

/// The rows of the first Markdown table after the heading `heading` (its header and separator
/// left out), each as its trimmed cells.
fn table_after(text: &str, heading: &str) -> Vec<Vec<String>> {
    let mut lines = text.lines().skip_while(|l| l.trim() != heading).skip(1);
    let rows: Vec<&str> = lines
        .by_ref()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .collect();
    rows.iter()
        .skip(2)
        .map(|row| {
            row.trim()
                .trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .collect()
}

/// Every number in `text` (digits with `.`, `,` and `–` ranges), unit or none.
fn numbers(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut current = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_digit() || (!current.is_empty() && matches!(c, '.' | ',' | '–')) {
            current.push(c);
        } else if !current.is_empty() {
            found.insert(current.trim_end_matches(['.', ',', '–']).to_owned());
            current.clear();
        }
    }
    found
}

/// Whether a "met?" cell says met, not met, or neither (reported, —).
fn verdict(cell: &str) -> &'static str {
    let cell = cell.replace('*', "").to_lowercase();
    if cell.starts_with("not met") {
        "not met"
    } else if cell.starts_with("met") {
        "met"
    } else {
        "reported"
    }
}

#[test]
fn each_readme_goal_row_quotes_its_benchmarks_row() {
    let root = repo_root();
    let readme = table_after(&read(&root.join("README.md")), "## Figures");
    let page = table_after(&read(&root.join("docs/benchmarks.md")), "## The goals");
    assert!(readme.len() >= 8, "the README's goal table: {readme:?}");
    assert_eq!(
        readme.len(),
        page.len(),
        "the README and docs/benchmarks.md list different goals"
    );
    // README: goal | target | current | met? | command;
    // benchmarks: goal | target | current figure | runs | met? | command.
    for (ours, theirs) in readme.iter().zip(&page) {
        let goal = &ours[0];
        let first_words = |s: &str| s.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
        assert_eq!(
            first_words(goal),
            first_words(&theirs[0]),
            "the README's goal {goal:?} and the benchmarks page's {:?} are not the same goal",
            theirs[0]
        );
        assert_eq!(ours.len(), 5, "README row {goal}");
        assert_eq!(theirs.len(), 6, "benchmarks row {}", theirs[0]);
        assert!(
            theirs[1].starts_with(&ours[1]),
            "{goal}: target {:?}, on the benchmarks page {:?}",
            ours[1],
            theirs[1]
        );
        let quoted: Vec<_> = numbers(&ours[2])
            .difference(&numbers(&theirs[2]))
            .cloned()
            .collect();
        assert!(
            quoted.is_empty(),
            "{goal}: the README's current figure {:?} states {quoted:?}, which its row on the \
             benchmarks page ({:?}) does not",
            ours[2],
            theirs[2]
        );
        assert!(!numbers(&ours[2]).is_empty(), "{goal}: no figure quoted");
        assert_eq!(verdict(&ours[3]), verdict(&theirs[4]), "{goal}: met?");
        assert!(
            theirs[5].starts_with(&ours[4]),
            "{goal}: the README's command {:?} is not the benchmarks page's {:?}",
            ours[4],
            theirs[5]
        );
    }
}

#[test]
fn numbers_and_tables_are_read_as_written() {
    let found: Vec<String> = numbers("61.0 and 62.0 MiB, 1.31× (0.14–2.10); 10,000 calls.")
        .into_iter()
        .collect();
    assert_eq!(found, ["0.14–2.10", "1.31", "10,000", "61.0", "62.0"]);
    let rows = table_after(
        "# x\n## T\n\ntext\n| a | b |\n|---|---|\n| 1 | two |\n| 3 | 4 |\n\n| c |\n",
        "## T",
    );
    assert_eq!(rows, [vec!["1", "two"], vec!["3", "4"]]);
}
