//! Chat templates from the model's metadata, rendered with minijinja.

use minijinja::{context, Environment};
use serde::Serialize;

use crate::error::{Error, Result};

/// One chat message.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A compiled chat template plus the special strings templates commonly reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::ChatTemplate(format!("template does not compile: {e}")))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The template stored with a model, if any, with the tokenizer's BOS/EOS strings.
    pub fn for_tokenizer(
        source: Option<&str>,
        tok: &crate::model::tokenizer::Tokenizer,
    ) -> Result<Option<ChatTemplate>> {
        let Some(src) = source else { return Ok(None) };
        let name = |id: Option<u32>| id.and_then(|i| tok.token_str(i)).unwrap_or_default();
        Ok(Some(ChatTemplate::new(
            src,
            name(tok.bos),
            name(tok.eos.first().copied()),
        )?))
    }

    /// Renders `messages`, appending the assistant's generation prompt when asked.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| Error::ChatTemplate(e.to_string()))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| Error::ChatTemplate(format!("rendering failed: {e}")))
    }

    /// Wraps one prompt as a user turn with the generation prompt.
    pub fn user_prompt(&self, prompt: &str) -> Result<String> {
        self.render(
            &[Message {
                role: "user".into(),
                content: prompt.into(),
            }],
            true,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let t = ChatTemplate::new(CHATML, String::new(), "<|im_end|>".into()).unwrap();
        let s = t.user_prompt("Hi?").unwrap();
        assert_eq!(
            s,
            "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn bad_template_is_an_error() {
        let e = ChatTemplate::new("{% for x in %}", String::new(), String::new()).unwrap_err();
        assert!(e.to_string().contains("does not compile"), "{e}");
    }

    #[test]
    fn raise_exception_surfaces_as_error() {
        let t = ChatTemplate::new(
            "{{ raise_exception('no system role') }}",
            String::new(),
            String::new(),
        )
        .unwrap();
        let e = t.user_prompt("x").unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
    }
}
