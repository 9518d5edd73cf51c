//! Volume and snapshot names. The store builds paths only from a [`Label`],
//! and a `Label` exists only for a valid DNS-1123 label: no '/', no '.',
//! no "..", nothing a path could be steered with.

/// A validated DNS-1123 label: 1..=63 of `[a-z0-9-]`, starting and ending
/// with an alphanumeric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Label<'a>(&'a str);

impl<'a> Label<'a> {
    pub(super) fn volume(name: &'a str) -> Result<Self, super::VolumeStoreError> {
        Self::parse("volume", name)
    }

    pub(super) fn snapshot(name: &'a str) -> Result<Self, super::VolumeStoreError> {
        Self::parse("snapshot", name)
    }

    fn parse(kind: &'static str, name: &'a str) -> Result<Self, super::VolumeStoreError> {
        check(name)
            .map(|()| Self(name))
            .map_err(|reason| super::VolumeStoreError::InvalidName {
                kind,
                name: name.into(),
                reason,
            })
    }

    pub(super) fn as_str(self) -> &'a str {
        self.0
    }
}

fn check(name: &str) -> Result<(), &'static str> {
    const RULE: &str = "must be a DNS-1123 label: lowercase letters, digits and '-', \
                        starting and ending with a letter or digit";
    if name.is_empty() {
        return Err("must not be empty");
    }
    if name.len() > 63 {
        return Err("must be at most 63 characters (DNS-1123 label)");
    }
    let b = name.as_bytes();
    let ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    if !b.iter().all(|&c| ok(c) || c == b'-') || !ok(b[0]) || !ok(b[b.len() - 1]) {
        return Err(RULE);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        for good in ["a", "data-1", "0abc", &"x".repeat(63)] {
            assert!(Label::volume(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a_b",
            "a.b",
            "..",
            ".",
            "a/b",
            "a\0",
            "é",
            &"x".repeat(64),
        ] {
            let err = Label::snapshot(bad).unwrap_err().to_string();
            assert!(err.contains("invalid snapshot name"), "{bad}: {err}");
        }
    }
}
