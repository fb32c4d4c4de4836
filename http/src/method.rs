//! The HTTP methods routes are declared with ([`Method`]). A leaf: the
//! route table matches requests on them and a 405 [`crate::Refusal`] names
//! the ones a path takes, so both name it here rather than one another.

/// The methods routes are declared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// `GET`.
    Get,
    /// `POST`.
    Post,
    /// `PUT`.
    Put,
    /// `DELETE`.
    Delete,
}

impl Method {
    /// The method as HTTP spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Delete => "DELETE",
        }
    }
}
