//! Reading YAML manifests (CRDs, examples, invalid-object tables) and
//! preparing them for a test: unique names, the scope label, the namespace.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use kube::api::DynamicObject;
use serde::Deserialize;

use crate::scope::TestScope;

/// One object read from a manifest file.
#[derive(Debug, Clone)]
pub struct Manifest {
    /// The file it came from.
    pub path: PathBuf,
    /// Its position among the documents of that file (0-based).
    pub index: usize,
    /// The object.
    pub object: DynamicObject,
}

impl Manifest {
    /// `path#index`, for messages.
    pub fn origin(&self) -> String {
        format!("{}#{}", self.path.display(), self.index)
    }
}

/// The `*.yaml` / `*.yml` files directly in `dir`, sorted by name.
pub fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry
            .with_context(|| format!("listing {}", dir.display()))?
            .path();
        let is_yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
        if is_yaml && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Every non-empty document of a multi-document YAML text as an object.
pub fn parse_objects(text: &str, path: &Path) -> Result<Vec<Manifest>> {
    let mut out = Vec::new();
    for (index, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc)
            .with_context(|| format!("parsing document {index} of {}", path.display()))?;
        if value.is_null() {
            continue;
        }
        let object: DynamicObject = serde_yaml::from_value(value).with_context(|| {
            format!(
                "document {index} of {} is not a Kubernetes object",
                path.display()
            )
        })?;
        if object.types.is_none() {
            bail!(
                "document {index} of {} has no apiVersion/kind",
                path.display()
            );
        }
        out.push(Manifest {
            path: path.to_owned(),
            index,
            object,
        });
    }
    Ok(out)
}

/// Reads every object of one file.
pub fn read_objects(path: &Path) -> Result<Vec<Manifest>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_objects(&text, path)
}

/// The substring an invalid-object file expects in the apiserver's error: its
/// first line must be `# expect: <substring>`.
pub fn expectation(text: &str) -> Option<String> {
    let first = text.lines().next()?.trim();
    let rest = first.strip_prefix('#')?.trim_start();
    let wanted = rest.strip_prefix("expect:")?.trim();
    (!wanted.is_empty()).then(|| wanted.to_owned())
}

/// Gives `object` a name unique to the test (`<prefix>-<name>`, or
/// `<prefix>-<fallback>` when it has none), the scope label and, when
/// `namespaced`, the test's namespace.
pub fn scoped(
    mut object: DynamicObject,
    scope: &TestScope,
    namespaced: bool,
    fallback: &str,
) -> DynamicObject {
    let base = object
        .metadata
        .name
        .clone()
        .unwrap_or_else(|| fallback.to_owned());
    object.metadata.name = Some(scope.name(&base));
    object.metadata.generate_name = None;
    let (key, value) = scope.label();
    object
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert(key.to_owned(), value.to_owned());
    object.metadata.namespace = namespaced.then(|| scope.namespace().to_owned());
    object
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expectation_comes_from_the_first_line_only() {
        assert_eq!(
            expectation("# expect: spec.mig.strategy\nkind: GpuPool\n").as_deref(),
            Some("spec.mig.strategy")
        );
        assert_eq!(
            expectation("#expect:   Unsupported value: \"x\"  \n").as_deref(),
            Some("Unsupported value: \"x\"")
        );
        assert_eq!(expectation("kind: GpuPool\n# expect: spec\n"), None);
        assert_eq!(expectation("# expect:\n"), None);
        assert_eq!(expectation(""), None);
    }

    #[test]
    fn multi_document_files_yield_each_object() {
        let text = "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\n---\n\
                    apiVersion: gpupool.io/v1alpha1\nkind: GpuPool\nmetadata: {name: b}\nspec: {}\n";
        let objects = parse_objects(text, Path::new("x.yaml")).unwrap();
        let names: Vec<_> = objects
            .iter()
            .map(|m| (m.object.metadata.name.clone().unwrap(), m.index))
            .collect();
        assert_eq!(names, [("a".to_owned(), 0), ("b".to_owned(), 2)]);
        assert_eq!(objects[1].object.types.as_ref().unwrap().kind, "GpuPool");
        assert_eq!(objects[1].origin(), "x.yaml#2");
    }

    #[test]
    fn documents_without_a_kind_are_errors() {
        let err = parse_objects("metadata: {name: a}\n", Path::new("bad.yaml")).unwrap_err();
        assert!(format!("{err:#}").contains("bad.yaml"), "{err:#}");
    }
}
