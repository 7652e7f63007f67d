//! The conformance report: one row per compared item, each equal, a documented difference
//! (by design, with the reason) or unexpected (a finding; the run fails).

use std::collections::BTreeSet;
use std::fmt::Debug;

/// How a row came out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Both sides the same.
    Equal,
    /// Different by design; the reason says why.
    Documented(String),
    /// Different, and nothing explains it.
    Unexpected,
}

/// One row.
#[derive(Debug, Clone)]
pub struct Row {
    /// Scenario.
    pub scenario: String,
    /// What was compared.
    pub item: String,
    /// Result.
    pub outcome: Outcome,
    /// Printed diff (empty when equal).
    pub detail: Vec<String>,
}

/// All rows of a run.
#[derive(Debug, Default)]
pub struct Report {
    /// Rows in order.
    pub rows: Vec<Row>,
}

impl Report {
    /// Adds a row.
    pub fn push(&mut self, scenario: &str, item: &str, outcome: Outcome, detail: Vec<String>) {
        let row = Row {
            scenario: scenario.to_owned(),
            item: item.to_owned(),
            outcome,
            detail,
        };
        print_row(&row);
        self.rows.push(row);
    }

    /// Compares two sets: equal, or documented when `documented` explains every difference
    /// (it gets the items only NVIDIA has and those only gpupool has).
    pub fn compare_sets<T: Ord + Debug + Clone>(
        &mut self,
        scenario: &str,
        item: &str,
        nvidia: &BTreeSet<T>,
        ours: &BTreeSet<T>,
        documented: impl Fn(&BTreeSet<T>, &BTreeSet<T>) -> Option<String>,
    ) {
        self.compare_sets_with(scenario, item, nvidia, ours, |n, o| {
            documented(n, o).map(Outcome::Documented)
        });
    }

    /// Like [`Report::compare_sets`], with a classifier that may also name a finding.
    pub fn compare_sets_with<T: Ord + Debug + Clone>(
        &mut self,
        scenario: &str,
        item: &str,
        nvidia: &BTreeSet<T>,
        ours: &BTreeSet<T>,
        classify: impl Fn(&BTreeSet<T>, &BTreeSet<T>) -> Option<Outcome>,
    ) {
        let only_nvidia: BTreeSet<T> = nvidia.difference(ours).cloned().collect();
        let only_ours: BTreeSet<T> = ours.difference(nvidia).cloned().collect();
        if only_nvidia.is_empty() && only_ours.is_empty() {
            self.push(
                scenario,
                item,
                Outcome::Equal,
                vec![format!("{} entries", nvidia.len())],
            );
            return;
        }
        let mut detail: Vec<String> = only_nvidia
            .iter()
            .map(|x| format!("- nvidia only: {x:?}"))
            .collect();
        detail.extend(only_ours.iter().map(|x| format!("+ gpupool only: {x:?}")));
        let outcome = classify(&only_nvidia, &only_ours).unwrap_or(Outcome::Unexpected);
        self.push(scenario, item, outcome, detail);
    }

    /// Rows with an unexpected difference.
    pub fn unexpected(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| r.outcome == Outcome::Unexpected)
            .count()
    }

    /// The summary table (Markdown).
    pub fn table(&self) -> String {
        let mut s = String::from("| scenario | compared | result |\n|---|---|---|\n");
        for row in &self.rows {
            let result = match &row.outcome {
                Outcome::Equal => format!("equal ({})", row.detail.join("; ")),
                Outcome::Documented(reason) => format!("documented difference: {reason}"),
                Outcome::Unexpected => "**UNEXPECTED difference** (see diff above)".to_owned(),
            };
            s.push_str(&format!(
                "| {} | {} | {} |\n",
                row.scenario,
                row.item,
                result.replace('|', "\\|")
            ));
        }
        s
    }
}

fn print_row(row: &Row) {
    let tag = match &row.outcome {
        Outcome::Equal => "EQUAL".to_owned(),
        Outcome::Documented(_) => "DOCUMENTED".to_owned(),
        Outcome::Unexpected => "UNEXPECTED".to_owned(),
    };
    println!("[{tag}] {} / {}", row.scenario, row.item);
    if let Outcome::Documented(reason) = &row.outcome {
        println!("    why: {reason}");
    }
    if row.outcome != Outcome::Equal {
        const MAX: usize = 40;
        for line in row.detail.iter().take(MAX) {
            println!("    {line}");
        }
        if row.detail.len() > MAX {
            println!("    … {} more", row.detail.len() - MAX);
        }
    }
}
