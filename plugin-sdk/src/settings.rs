//! Plugin settings from the host's config (`[plugins.NAME.settings]`), as key/value text with
//! typed getters whose errors name the key.

use std::str::FromStr;

/// The settings a plugin instance was configured with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    entries: Vec<(String, String)>,
}

impl Settings {
    pub fn new(entries: Vec<(String, String)>) -> Self {
        Settings { entries }
    }

    /// The raw text of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// `key` parsed as `T`, or `default` when it is not set.
    pub fn parse_or<T: FromStr>(&self, key: &str, default: T) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        match self.get(key) {
            None => Ok(default),
            Some(text) => text
                .parse()
                .map_err(|e| format!("setting `{key}` = {text:?}: {e}")),
        }
    }

    /// Fails on the first key not in `known`, naming it and the known ones.
    pub fn reject_unknown(&self, known: &[&str]) -> Result<(), String> {
        match self
            .entries
            .iter()
            .find(|(k, _)| !known.contains(&k.as_str()))
        {
            None => Ok(()),
            Some((k, _)) if known.is_empty() => Err(format!(
                "unknown setting `{k}` (this plugin takes no settings)"
            )),
            Some((k, _)) => Err(format!(
                "unknown setting `{k}` (known: {})",
                known.join(", ")
            )),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(pairs: &[(&str, &str)]) -> Settings {
        Settings::new(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn typed_getters_and_errors_name_the_key() {
        let st = s(&[("mass", "0.9"), ("bad", "x")]);
        assert_eq!(st.parse_or("mass", 1.0f32), Ok(0.9));
        assert_eq!(st.parse_or("absent", 3u32), Ok(3));
        let e = st.parse_or("bad", 1.0f32).unwrap_err();
        assert!(e.contains("`bad`"), "{e}");
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let st = s(&[("mass", "0.9"), ("typo", "1")]);
        let e = st.reject_unknown(&["mass"]).unwrap_err();
        assert!(e.contains("`typo`") && e.contains("mass"), "{e}");
        assert!(s(&[]).reject_unknown(&[]).is_ok());
    }
}
