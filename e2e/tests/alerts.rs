//! The chart's alerting rules (`charts/gpupool/files/prometheus-rules.yaml`) under promtool:
//! `check rules` (syntax, templates) and `test rules` on `e2e/prometheus/prometheus-rules.test.yaml`,
//! where each alert fires on its fault and stays silent on healthy series. Needs no cluster.
//! Without promtool it fails under CI (which installs Debian's `prometheus` package) and skips
//! with a message elsewhere.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use gpupool_e2e::prometheus::{find_tool, rules_file, rules_test_file};

fn promtool(tool: &Path, args: &[&str], dir: &Path) -> Result<String> {
    let out = Command::new(tool)
        .args(args)
        .current_dir(dir)
        .output()
        .with_context(|| format!("running {}", tool.display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "promtool {args:?} failed:\n{text}");
    Ok(text)
}

#[test]
fn alert_rules_pass_promtool() -> Result<()> {
    let Some(tool) = find_tool("promtool")? else {
        eprintln!(
            "e2e: SKIPPED alert_rules_pass_promtool: promtool not found (apt-get install prometheus)"
        );
        return Ok(());
    };
    let rules = rules_file();
    let tests = rules_test_file();
    let dir = tests.parent().context("the test file has a directory")?;
    let checked = promtool(&tool, &["check", "rules", &rules.to_string_lossy()], dir)?;
    ensure!(checked.contains("SUCCESS: 9 rules found"), "{checked}");
    let tested = promtool(&tool, &["test", "rules", &tests.to_string_lossy()], dir)?;
    ensure!(tested.contains("SUCCESS"), "{tested}");
    Ok(())
}
