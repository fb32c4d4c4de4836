//! The route table: (method, path) → handler, each route open or signed,
//! and the one rule for the requests no route takes.

use std::sync::Arc;

use crate::{Method, Refusal, Reply, Request};

/// Who may reach a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Whoever the [`Gate`] lets in (everyone, without one).
    Open,
    /// Only requests the [`Gate`] finds signed (nobody, without one).
    Signed,
}

/// Answers a request its route took.
type Handler = Arc<dyn Fn(&Request<'_>) -> Reply + Send + Sync>;

/// What a server asks of every request before it goes on to its route, or
/// to its 404 or 405: where the route is [`Access::Signed`], a signature
/// ([`crate::verify_signed`]); whatever else the server wants of every
/// caller (an address's budget, callers on its own host only).
pub trait Gate: Send + Sync {
    /// `Err(reply)`: `request` is answered with `reply` instead. `access`
    /// is what its route asks, or [`Routes::unmatched`] when no route
    /// takes it.
    fn check(&self, request: &Request<'_>, access: Access) -> Result<(), Reply>;
}

struct Route {
    method: Method,
    path: String,
    access: Access,
    handler: Handler,
}

/// A server's routes, what a request no route takes must pass before it
/// hears 404 or 405, and the gate that checks them.
pub struct Routes {
    routes: Vec<Route>,
    unmatched: Access,
    gate: Option<Arc<dyn Gate>>,
}

impl Default for Routes {
    fn default() -> Self {
        Routes::new()
    }
}

impl Routes {
    /// No routes, unmatched requests open, no gate.
    pub fn new() -> Routes {
        Routes {
            routes: Vec::new(),
            unmatched: Access::Open,
            gate: None,
        }
    }

    /// The table with `method path` answered by `handler` for whoever
    /// `access` lets in. `path` is matched exactly, without the query.
    ///
    /// # Panics
    ///
    /// When `method path` has a route already: which of two would answer
    /// is a mistake of the table, not of a request.
    pub fn route(
        mut self,
        method: Method,
        path: &str,
        access: Access,
        handler: impl Fn(&Request<'_>) -> Reply + Send + Sync + 'static,
    ) -> Routes {
        assert!(
            !self
                .routes
                .iter()
                .any(|r| r.method == method && r.path == path),
            "two routes for {} {path}",
            method.as_str()
        );
        self.routes.push(Route {
            method,
            path: path.to_string(),
            access,
            handler: Arc::new(handler),
        });
        self
    }

    /// The table with requests no route takes (unknown paths, other
    /// methods) let through to their 404 or 405 only as `access` allows:
    /// [`Access::Signed`] tells an unsigned caller nothing but the gate's
    /// refusal.
    pub fn unmatched(mut self, access: Access) -> Routes {
        self.unmatched = access;
        self
    }

    /// The table with `gate` checking every request.
    pub fn gate(mut self, gate: Arc<dyn Gate>) -> Routes {
        self.gate = Some(gate);
        self
    }

    /// The gate's verdict, then the route's answer, or the refusal of a
    /// request no route takes.
    pub(crate) fn dispatch(&self, request: &Request<'_>) -> Result<Reply, Refusal> {
        let route = self.find(request.method(), request.path());
        let access = route.map_or(self.unmatched, |r| r.access);
        match (&self.gate, access) {
            (Some(gate), _) => {
                if let Err(reply) = gate.check(request, access) {
                    return Ok(reply);
                }
            }
            (None, Access::Signed) => return Err(Refusal::Unauthorized),
            (None, Access::Open) => {}
        }
        match route {
            Some(route) => Ok((route.handler)(request)),
            None => Err(self.unmatched_refusal(request)),
        }
    }

    fn find(&self, method: &str, path: &str) -> Option<&Route> {
        self.routes
            .iter()
            .find(|r| r.path == path && r.method.as_str() == method)
    }

    /// 405 when some route has the path, 404 when none has.
    fn unmatched_refusal(&self, request: &Request<'_>) -> Refusal {
        let path = request.path();
        let allow: Vec<Method> = self
            .routes
            .iter()
            .filter(|r| r.path == path)
            .map(|r| r.method)
            .collect();
        if allow.is_empty() {
            return Refusal::NotFound {
                path: path.to_string(),
            };
        }
        Refusal::MethodNotAllowed {
            method: request.method().to_string(),
            path: path.to_string(),
            allow,
        }
    }
}
