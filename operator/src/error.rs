//! The operator's errors.

/// Everything that can go wrong in a reconcile or at start-up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done, e.g. `applying GpuNode gpu-node-0`.
        action: String,
        /// The verb as RBAC names it, e.g. `patch`.
        verb: &'static str,
        /// The resource as RBAC names it, e.g. `nodes`, `pods/eviction`.
        resource: &'static str,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The finalizer machinery failed.
    #[error("finalizer of GpuPool {pool}: {source}")]
    Finalizer {
        /// The pool.
        pool: String,
        /// What failed.
        #[source]
        source: Box<kube::runtime::finalizer::Error<Error>>,
    },
    /// An object lacks a field the API always sets.
    #[error("{0} has no {1}")]
    MissingField(String, &'static str),
    /// Serializing a patch failed.
    #[error("serializing {what}: {source}")]
    Serialize {
        /// What was being serialized.
        what: String,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// A GpuPool the API holds cannot be read as one.
    #[error("GpuPool {pool} is malformed: {message}")]
    InvalidPool {
        /// The pool.
        pool: String,
        /// What the deserializer said.
        message: String,
    },
    /// A write that hands a node its desired state (a MIG layout, a sharing mode, a fence)
    /// was not made: this replica no longer leads, or is shutting down.
    #[error("{0}: not written, this replica no longer leads")]
    NotLeading(String),
}

impl Error {
    /// Wraps an API error with the call (`verb` on `resource`, as RBAC names them) and what
    /// was being done.
    pub fn kube(
        verb: &'static str,
        resource: &'static str,
        action: impl Into<String>,
    ) -> impl FnOnce(kube::Error) -> Error {
        let action = action.into();
        move |source| Error::Kube {
            action,
            verb,
            resource,
            source,
        }
    }

    /// The failed API call behind this error, for the pool's status, if it is one worth
    /// reporting there (see [`ApiFailure::worth_reporting`]).
    pub fn api_failure(&self) -> Option<ApiFailure> {
        let failure = match self {
            Error::Kube {
                action,
                verb,
                resource,
                source,
            } => ApiFailure::new(verb, resource, action.clone(), source),
            Error::Finalizer { pool, source } => {
                use kube::runtime::finalizer::Error as F;
                match source.as_ref() {
                    F::ApplyFailed(e) | F::CleanupFailed(e) => return e.api_failure(),
                    F::AddFinalizer(e) => ApiFailure::new(
                        "patch",
                        "gpupools",
                        format!("adding the finalizer to GpuPool {pool}"),
                        e,
                    ),
                    F::RemoveFinalizer(e) => ApiFailure::new(
                        "patch",
                        "gpupools",
                        format!("removing the finalizer from GpuPool {pool}"),
                        e,
                    ),
                    _ => return None,
                }
            }
            _ => return None,
        };
        failure.worth_reporting().then_some(failure)
    }

    /// A short, fixed category for metrics labels.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Kube { .. } => "api",
            Error::Finalizer { .. } => "finalizer",
            Error::MissingField(..) => "missing_field",
            Error::Serialize { .. } => "serialize",
            Error::InvalidPool { .. } => "invalid_pool",
            Error::NotLeading(_) => "not_leading",
        }
    }
}

/// Longest API server message kept in a failure (they are a line or two; this bounds the
/// pool's status whatever comes back).
const MAX_SERVER_MESSAGE: usize = 400;

/// An API call that failed, as the pool's status and Events report it: which verb on which
/// resource, what the operator was doing, and what the API server said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiFailure {
    /// The verb as RBAC names it.
    pub verb: &'static str,
    /// The resource as RBAC names it.
    pub resource: &'static str,
    /// What the operator was doing, e.g. `labelling/tainting node gpu-node-0`.
    pub action: String,
    /// The HTTP status, when the API server answered.
    pub code: Option<u16>,
    /// What the API server (or the client) said.
    pub message: String,
}

impl ApiFailure {
    /// A failure from the error of a call.
    pub fn new(
        verb: &'static str,
        resource: &'static str,
        action: impl Into<String>,
        error: &kube::Error,
    ) -> Self {
        let (code, message) = match error {
            kube::Error::Api(status) if !status.message.is_empty() => {
                (Some(status.code), status.message.clone())
            }
            kube::Error::Api(status) => (Some(status.code), status.reason.clone()),
            other => (None, other.to_string()),
        };
        let message = if message.chars().count() > MAX_SERVER_MESSAGE {
            let mut cut: String = message.chars().take(MAX_SERVER_MESSAGE).collect();
            cut.push('…');
            cut
        } else {
            message
        };
        Self {
            verb,
            resource,
            action: action.into(),
            code,
            message,
        }
    }

    /// Whether the pool's status should carry it: a 409 Conflict is the expected outcome of a
    /// write racing another (optimistic concurrency), settled by the retry, so it is only
    /// logged.
    pub fn worth_reporting(&self) -> bool {
        self.code != Some(409)
    }

    /// Whether the API server refused the operator's credentials or permissions: then no
    /// retry helps until someone fixes the RBAC or the credentials.
    pub fn refused(&self) -> bool {
        matches!(self.code, Some(401 | 403))
    }

    /// One sentence saying what failed and what to do about it.
    pub fn summary(&self) -> String {
        let (verb, resource, action, message) =
            (self.verb, self.resource, &self.action, &self.message);
        match self.code {
            Some(403) => format!(
                "the operator cannot {verb} {resource}: forbidden — check the chart's ClusterRole, which must grant {verb} on {resource} ({action}: {message})"
            ),
            Some(401) => format!(
                "the operator cannot {verb} {resource}: unauthorized — its credentials (service account token or kubeconfig) were rejected ({action}: {message})"
            ),
            Some(code) => {
                format!("{verb} {resource} failed with HTTP {code} ({action}: {message})")
            }
            None => format!("{verb} {resource} failed ({action}: {message})"),
        }
    }
}

/// The API calls that failed during one reconcile. Collected rather than returned at the
/// first one, so the rest of the reconcile still runs and the pool's status can name them.
#[derive(Debug, Default)]
pub struct Failures {
    /// Errors that fail the reconcile: it is retried with backoff.
    pub errors: Vec<Error>,
    /// Calls the API server refused (401/403) that the reconcile went past — a reclaim or
    /// drain action, whose outcome history and Events already record; reported, not retried
    /// sooner.
    pub refused: Vec<ApiFailure>,
}

impl Failures {
    /// Keeps an error that fails the reconcile.
    pub fn push(&mut self, error: Error) {
        self.errors.push(error);
    }

    /// Keeps the result's error, if any.
    pub fn check(&mut self, result: Result<()>) {
        if let Err(e) = result {
            self.push(e);
        }
    }

    /// Notes a call whose failure the reconcile went past, when it was refused.
    pub fn note(
        &mut self,
        verb: &'static str,
        resource: &'static str,
        action: impl Into<String>,
        error: &kube::Error,
    ) {
        let failure = ApiFailure::new(verb, resource, action, error);
        if failure.refused() {
            self.refused.push(failure);
        }
    }

    /// Everything the pool's status should report, in the order it happened.
    pub fn reported(&self) -> Vec<ApiFailure> {
        self.errors
            .iter()
            .filter_map(Error::api_failure)
            .chain(self.refused.iter().cloned())
            .collect()
    }

    /// `Ok` when no error fails the reconcile; else the first error, the others logged.
    pub fn into_result(self) -> Result<()> {
        let mut errors = self.errors.into_iter();
        match errors.next() {
            None => Ok(()),
            Some(first) => {
                for other in errors {
                    tracing::warn!(error = %other, "API call failed");
                }
                Err(first)
            }
        }
    }
}

/// The HTTP status of an API error, if it is one.
pub fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// Result with the operator's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(Box::new(
            kube::core::Status::failure(message, "Reason").with_code(code),
        ))
    }

    #[test]
    fn summaries_say_what_failed_and_what_to_do() {
        let cases = [
            (
                api_error(403, "nodes \"n1\" is forbidden"),
                "the operator cannot patch nodes: forbidden — check the chart's ClusterRole, which must grant patch on nodes (labelling n1: nodes \"n1\" is forbidden)",
            ),
            (
                api_error(401, "Unauthorized"),
                "the operator cannot patch nodes: unauthorized — its credentials (service account token or kubeconfig) were rejected (labelling n1: Unauthorized)",
            ),
            (
                api_error(500, "etcdserver: timeout"),
                "patch nodes failed with HTTP 500 (labelling n1: etcdserver: timeout)",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(
                ApiFailure::new("patch", "nodes", "labelling n1", &e).summary(),
                want
            );
        }
        let long = ApiFailure::new("patch", "nodes", "x", &api_error(500, &"y".repeat(1000)));
        assert_eq!(long.message.chars().count(), MAX_SERVER_MESSAGE + 1);
    }

    #[test]
    fn conflicts_are_not_reported_and_finalizer_errors_are() {
        let conflict = Error::kube("patch", "nodes", "labelling n1")(api_error(409, "conflict"));
        assert_eq!(conflict.api_failure(), None);
        let forbidden = Error::kube("patch", "nodes", "labelling n1")(api_error(403, "no"));
        assert_eq!(forbidden.api_failure().map(|f| f.code), Some(Some(403)));
        let add = Error::Finalizer {
            pool: "p".into(),
            source: Box::new(kube::runtime::finalizer::Error::AddFinalizer(api_error(
                403, "no",
            ))),
        };
        let f = add.api_failure().unwrap();
        assert_eq!((f.verb, f.resource), ("patch", "gpupools"));
        assert!(f.action.contains("adding the finalizer"), "{}", f.action);
        let cleanup = Error::Finalizer {
            pool: "p".into(),
            source: Box::new(kube::runtime::finalizer::Error::CleanupFailed(Error::kube(
                "delete",
                "gpunodes",
                "deleting GpuNode n1",
            )(
                api_error(403, "no"),
            ))),
        };
        assert_eq!(cleanup.api_failure().map(|f| f.resource), Some("gpunodes"));
        assert_eq!(Error::MissingField("x".into(), "y").api_failure(), None);
    }

    #[test]
    fn failures_keep_every_error_and_only_refused_notes() {
        let mut f = Failures::default();
        assert!(Failures::default().into_result().is_ok());
        f.note(
            "create",
            "pods/eviction",
            "evicting a",
            &api_error(500, "pdb"),
        );
        f.note(
            "create",
            "pods/eviction",
            "evicting b",
            &api_error(403, "no"),
        );
        f.check(Ok(()));
        f.check(Err(Error::kube("patch", "pods", "annotating c")(
            api_error(403, "no"),
        )));
        f.push(Error::kube("patch", "nodes", "labelling n1")(api_error(
            409, "conflict",
        )));
        let reported: Vec<String> = f.reported().into_iter().map(|r| r.action).collect();
        assert_eq!(reported, vec!["annotating c", "evicting b"]);
        let first = f.into_result().unwrap_err();
        assert!(first.to_string().starts_with("annotating c: "), "{first}");
    }
}
