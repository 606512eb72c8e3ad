//! The default model against an independent fp32 numpy forward pass
//! (`tests/data/smollm2_greedy.json`): tokenization, first greedy token, greedy agreement.

mod common;

use deepinfer::runtime::PromptInput;

#[test]
fn default_model_matches_the_numpy_reference() {
    let cases = common::reference_cases();
    let model = common::default_model();
    for c in &cases {
        let ids = model.tokenizer.encode(&c.prompt).expect("tokenizes");
        assert_eq!(ids, c.prompt_ids, "tokenization of {:?}", c.prompt);
    }
    let llm = common::engine(model);
    let requests: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            common::greedy(
                &i.to_string(),
                PromptInput::Text(c.prompt.clone()),
                c.greedy_ids.len().max(1),
            )
        })
        .collect();
    let outputs = llm.generate(&requests, &mut |_| {});
    let (mut matched, mut total) = (0usize, 0usize);
    for (c, o) in cases.iter().zip(&outputs) {
        assert!(o.error.is_none(), "{:?}: {:?}", c.prompt, o.error);
        assert_eq!(o.prompt_token_ids, c.prompt_ids);
        assert_eq!(
            o.token_ids.first(),
            c.greedy_ids.first(),
            "first greedy token for {:?}",
            c.prompt
        );
        assert!(c.top5_next.contains(&o.token_ids[0]));
        let common_prefix = o
            .token_ids
            .iter()
            .zip(&c.greedy_ids)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "{:?}: {}/{} greedy tokens agree: {:?}",
            c.prompt,
            common_prefix,
            c.greedy_ids.len(),
            o.text
        );
        matched += common_prefix;
        total += c.greedy_ids.len();
    }
    let share = matched as f64 / total as f64;
    eprintln!(
        "greedy agreement: {matched}/{total} = {:.1}%",
        share * 100.0
    );
    assert!(
        share >= 0.9,
        "only {matched}/{total} reference greedy tokens matched as common prefixes"
    );
}

#[test]
fn chat_prompt_renders_with_the_model_template() {
    let model = common::default_model();
    let tpl = model
        .chat_template
        .as_ref()
        .expect("the default model has a chat template");
    let text = tpl
        .user_prompt("What is the capital of France?")
        .expect("renders");
    assert!(
        text.ends_with(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        ),
        "{text:?}"
    );
    let ids = model.tokenizer.encode(&text).expect("tokenizes");
    // Control tokens are single ids: <|im_start|> = 1, <|im_end|> = 2.
    assert_eq!(ids.iter().filter(|&&t| t == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&t| t == 2).count(), 2);
}
