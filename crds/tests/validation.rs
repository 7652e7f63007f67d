//! Admission rules of the GpuPool CRD, checked client-side against the generated schema:
//! every file in `tests/invalid/` must be rejected by the layer it names (`schema` or `cel`)
//! with the message it expects, and every example and `tests/valid/` file must pass both.
//!
//! The same `tests/invalid/` files are sent to a real kube-apiserver by the e2e suite.

use gpupool_crds::{GpuPool, GpuPoolSpec};
use kube::CustomResourceExt;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The schema of the CRD of `kind` (GpuPool or GpuNode).
fn schema_of(kind: &str) -> Value {
    match kind {
        "GpuNode" => schema(gpupool_crds::node::GpuNode::crd()),
        _ => pool_schema(),
    }
}

fn pool_schema() -> Value {
    schema(GpuPool::crd())
}

fn schema(
    crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> Value {
    let name = crd.metadata.name.clone().unwrap_or_default();
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .unwrap_or_else(|| panic!("{name} has a schema"));
    serde_json::to_value(schema).expect("schema serializes")
}

struct Case {
    path: PathBuf,
    expect: String,
    layer: String,
    object: Value,
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
}

fn header(text: &str, key: &str) -> Option<String> {
    text.lines()
        .take_while(|l| l.starts_with('#'))
        .find_map(|l| l.strip_prefix(&format!("# {key}: ")).map(str::to_string))
}

fn load(path: &Path) -> Case {
    let text = std::fs::read_to_string(path).expect("read case");
    let object: Value = serde_yaml::from_str(&text).expect("case is YAML");
    Case {
        path: path.to_path_buf(),
        expect: header(&text, "expect").unwrap_or_default(),
        layer: header(&text, "layer").unwrap_or_default(),
        object,
    }
}

/// Structural-schema errors (types, enums, patterns, bounds, required fields).
fn schema_errors(schema: &Value, object: &Value) -> Vec<String> {
    let validator = jsonschema::validator_for(schema).expect("schema compiles as JSON Schema");
    validator
        .iter_errors(object)
        .map(|e| format!("{}: {e}", e.instance_path))
        .collect()
}

/// CEL (`x-kubernetes-validations`) errors, evaluated on the defaulted object as the
/// apiserver does: every rule in the schema tree, with `self` bound to the value at its node.
///
/// kube-cel's own `Validator` escapes map keys under `additionalProperties` (`1g.10gb` becomes
/// `1g__dot__10gb`); the apiserver escapes only declared property names. Our profile rules read
/// map keys, so this walker converts values without escaping and uses kube-cel only for the
/// Kubernetes CEL function library.
fn cel_errors(schema: &Value, object: &Value) -> Vec<String> {
    let defaulted = kube_cel::apply_defaults(schema, object);
    let mut errors = Vec::new();
    walk_rules(schema, &defaulted, "", &mut errors);
    errors
}

fn walk_rules(schema: &Value, value: &Value, path: &str, errors: &mut Vec<String>) {
    use kube_cel::KubeCelExt;
    use kube_cel::cel::{Context, Program, Value as Cel};
    if value.is_null() {
        return;
    }
    if let Some(rules) = schema
        .get("x-kubernetes-validations")
        .and_then(Value::as_array)
    {
        for rule in rules {
            let expr = rule["rule"].as_str().expect("rule text");
            let mut ctx = Context::default().with_all();
            ctx.add_variable_from_value("self", to_cel(value));
            let program =
                Program::compile(expr).unwrap_or_else(|e| panic!("rule {expr:?} compiles: {e:?}"));
            match program.execute(&ctx) {
                Ok(Cel::Bool(true)) => {}
                Ok(Cel::Bool(false)) => errors.push(format!(
                    "{path}: {}",
                    rule["message"].as_str().unwrap_or(expr)
                )),
                other => errors.push(format!("{path}: rule {expr:?} did not evaluate: {other:?}")),
            }
        }
    }
    match value {
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            for (key, child) in map {
                let child_schema = props.and_then(|p| p.get(key)).or(additional);
                if let Some(child_schema) = child_schema {
                    walk_rules(child_schema, child, &format!("{path}.{key}"), errors);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    walk_rules(item_schema, item, &format!("{path}[{i}]"), errors);
                }
            }
        }
        _ => {}
    }
}

fn to_cel(value: &Value) -> kube_cel::cel::Value {
    use kube_cel::cel::Value as Cel;
    use kube_cel::cel::objects::{Key, Map};
    use std::sync::Arc;
    match value {
        Value::Null => Cel::Null,
        Value::Bool(b) => Cel::Bool(*b),
        Value::Number(n) => n
            .as_i64()
            .map(Cel::Int)
            .unwrap_or_else(|| Cel::Float(n.as_f64().unwrap_or(f64::NAN))),
        Value::String(s) => Cel::String(Arc::new(s.clone())),
        Value::Array(items) => Cel::List(Arc::new(items.iter().map(to_cel).collect())),
        Value::Object(map) => Cel::Map(Map {
            map: Arc::new(
                map.iter()
                    .map(|(k, v)| (Key::String(Arc::new(k.clone())), to_cel(v)))
                    .collect(),
            ),
        }),
    }
}

fn valid_files() -> Vec<PathBuf> {
    let mut files = yaml_files(&repo_root().join("examples"));
    files.extend(yaml_files(&repo_root().join("crds/tests/valid")));
    files
}

#[test]
fn every_invalid_case_is_rejected_by_its_layer_with_its_message() {
    let cases: Vec<Case> = yaml_files(&repo_root().join("crds/tests/invalid"))
        .iter()
        .map(|p| load(p))
        .collect();
    assert!(
        cases.len() >= 80,
        "expected at least 80 invalid cases, found {}",
        cases.len()
    );
    let mut failures = Vec::new();
    for case in &cases {
        assert!(
            !case.expect.is_empty(),
            "{} lacks '# expect:'",
            case.path.display()
        );
        let schema = schema_of(case.object["kind"].as_str().unwrap_or_default());
        let errors = match case.layer.as_str() {
            "schema" => schema_errors(&schema, &case.object),
            "cel" => {
                // A CEL case must be structurally valid, or it would test the wrong rule.
                let structural = schema_errors(&schema, &case.object);
                assert!(
                    structural.is_empty(),
                    "{}: CEL case fails the schema too: {structural:?}",
                    case.path.display()
                );
                cel_errors(&schema, &case.object)
            }
            other => panic!("{}: unknown layer {other:?}", case.path.display()),
        };
        if errors.is_empty() {
            failures.push(format!("{}: accepted", case.path.display()));
        } else if case.layer == "cel" && !errors.iter().any(|e| e.contains(&case.expect)) {
            failures.push(format!(
                "{}: errors {errors:?} lack {:?}",
                case.path.display(),
                case.expect
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_example_and_valid_case_passes_schema_and_cel_and_parses() {
    let schema = pool_schema();
    let files = valid_files();
    assert!(
        files.len() >= 10,
        "expected examples and valid cases, found {}",
        files.len()
    );
    for path in files {
        let case = load(&path);
        assert_eq!(
            schema_errors(&schema, &case.object),
            Vec::<String>::new(),
            "{}",
            path.display()
        );
        assert_eq!(
            cel_errors(&schema, &case.object),
            Vec::<String>::new(),
            "{}",
            path.display()
        );
        let pool: GpuPool = serde_json::from_value(case.object.clone())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // Round trip: serializing and parsing again gives the same object.
        let again: GpuPool =
            serde_json::from_value(serde_json::to_value(&pool).expect("serialize"))
                .expect("parse round trip");
        assert_eq!(pool.spec, again.spec, "{}", path.display());
        let yaml = serde_yaml::to_string(&pool).expect("yaml");
        let from_yaml: GpuPool = serde_yaml::from_str(&yaml).expect("yaml round trip");
        assert_eq!(pool.spec, from_yaml.spec, "{}", path.display());
    }
}

#[test]
fn a_pool_with_only_a_node_selector_gets_useful_defaults() {
    let spec: GpuPoolSpec = serde_json::from_value(serde_json::json!({
        "nodeSelector": {"matchLabels": {"nvidia.com/gpu.present": "true"}}
    }))
    .expect("minimal spec parses");
    assert_eq!(spec.driver.checks.len(), 7, "all checks on by default");
    assert_eq!(
        spec.driver.on_failure,
        gpupool_crds::policy::OnFailure::Report
    );
    assert!(spec.cdi.enabled);
    assert_eq!(spec.cdi.spec_dir, "/var/run/cdi");
    assert_eq!(spec.cdi.driver_root, "/");
    assert_eq!(spec.cdi.kind, "gpupool.io/gpu");
    assert_eq!(spec.mig.strategy, gpupool_crds::policy::MigStrategy::None);
    assert!(spec.mig.layout.is_none(), "MIG left as found by default");
    assert_eq!(spec.reclaim.mode, gpupool_crds::policy::ReclaimMode::DryRun);
    assert_eq!(
        spec.reclaim.action,
        gpupool_crds::policy::ReclaimAction::Auto
    );
    assert_eq!(
        spec.reclaim.idle_after,
        std::time::Duration::from_secs(2 * 3600)
    );
    assert!(!spec.reclaim.allow_delete);
}

#[test]
fn schema_defaults_match_serde_defaults() {
    // What the apiserver stores for a minimal pool (schema defaults) must be what the
    // Rust types assume when a field is absent, or the operator and `kubectl get -o yaml`
    // would disagree.
    let schema = pool_schema();
    let minimal = serde_json::json!({
        "apiVersion": "gpupool.io/v1alpha1", "kind": "GpuPool",
        "metadata": {"name": "m"},
        "spec": {"nodeSelector": {"matchLabels": {"a": "b"}}, "driver": {}, "cdi": {}, "mig": {}, "reclaim": {}}
    });
    let defaulted = kube_cel::apply_defaults(&schema, &minimal);
    let from_schema: GpuPool = serde_json::from_value(defaulted).expect("defaulted parses");
    let from_serde: GpuPool = serde_json::from_value(minimal).expect("minimal parses");
    assert_eq!(from_schema.spec, from_serde.spec);
}
