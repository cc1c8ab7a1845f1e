"""Text around the model: the tokenizer, the chat template (`templates/`), and the tool-call
parser with its argument encoding."""
