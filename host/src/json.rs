//! JSON helpers shared by writers and tests.

use serde_json::Value;

/// `v` with every object's keys sorted, at every depth. Serializing this gives one byte order
/// whether or not serde_json keeps insertion order — a cargo feature that some crates in a
/// workspace-wide build switch on (llguidance does) and a single-package build may not — so
/// files written and strings compared do not depend on how the build was invoked.
pub fn sorted_keys(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), sorted_keys(&m[k])))
                    .collect(),
            )
        }
        Value::Array(a) => Value::Array(a.iter().map(sorted_keys).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_sorted_at_every_depth() {
        let v: Value = serde_json::from_str(r#"{"b":1,"a":[{"z":0,"y":{"d":1,"c":2}}]}"#).unwrap();
        assert_eq!(
            sorted_keys(&v).to_string(),
            r#"{"a":[{"y":{"c":2,"d":1},"z":0}],"b":1}"#
        );
    }
}
