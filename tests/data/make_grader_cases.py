"""Writes tests/data/grader_cases.jsonl: hand-written grading cases (issue 15), each with the rule it tests.

    python tests/data/make_grader_cases.py   # from the repository root
"""
import json

# (answer as the model writes it, reference, correct?) - the answer forms of the issue and their neighbours
ANSWERS = [
    (r"\frac{4}{35}", "4/35", 1), (r"\frac{4}{35}", "35", 0), (r"\sqrt{17}", r"\sqrt{17}", 1), (r"\sqrt{17}", "17", 0),
    (r"16\pi", r"16\pi", 1), (r"16\pi", "16", 0), (r"-\frac{24}{25}", r"-\frac{24}{25}", 1), (r"-\frac{24}{25}", "25", 0),
    ("18", "18", 1), ("18", "19", 0), ("-3.5", "-3.5", 1), ("0.5", r"\frac12", 1), (r"\dfrac{6}{8}", r"\frac34", 1),
    ("1,234", "1234", 1), ("17.5", r"17.5\%", 1), (r"12.5\%", "12.5", 1), ("25", r"25\%", 1), ("17.5%", "0.175", 0),
    (r"8\sqrt{3}", r"8\sqrt{3}\text { square inches}", 1), (r"8\sqrt{3}\text{ square inches}", r"8\sqrt{3}", 1),
    (r"\textbf{(073)}", "073", 1), ("(073)", "73", 1), ("x = 5", "5", 1), (r"\$118,000", "118000", 1),
    ("½", "0.5", 1), ("５", "5", 1), ("√2", r"\sqrt{2}", 1), ("3½", r"\frac{7}{2}", 1), ("x²", "x^2", 1), ("−4", "-4", 1),
    ("twelve", "12", 1), (r"\{1, 2\}", r"\{2, 1\}", 1), ("(1, 2)", "(2, 1)", 0), (r"x^2 + 2x", "x(x+2)", 1),
    (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}", 1), ("2.0", "2", 1), ("7", "-7", 0), (r"\pi", "3.14", 0),
]
STYLES = [  # how models close a solution (the rule each tests)
    ("boxed", "So the result follows.\n\nTherefore the answer is $\\boxed{{{a}}}$."),
    ("minerva", "Working as above gives it.\nFinal Answer: The final answer is ${a}$. I hope it is correct."),
    ("qwen_final_heading", "Putting the steps together.\n\n**Final Answer**\n\n\\[ {a} \\]"),
    ("answer_is", "Adding the two parts, the answer is ${a}$."),
    ("answer_colon", "Let me check the arithmetic once more.\n\n**Answer:** ${a}$"),
]
cases = []
for a, gold, ok in ANSWERS:
    for style, template in STYLES:
        cases.append({"rule": f"style:{style}", "completion": template.format(a=a), "answer": gold, "correct": ok})

# The failure classes of the issue, one or more cases each, written out.
EXTRA = [
    ("fallback:latex", "Dividing, we get $\\frac{4}{35}$", "4/35", 1),
    ("fallback:latex", "so the length is $\\sqrt{17}$", "\\sqrt{17}", 1),
    ("fallback:latex", "the area comes to $16\\pi$", "16\\pi", 1),
    ("fallback:latex", "which gives $-\\frac{24}{25}$", "-\\frac{24}{25}", 1),
    ("fallback:latex", "which gives $-\\frac{24}{25}$", "25", 0),
    ("fallback:restated", "So she works 34 hours. The total is 34 hours in 4 weeks", "34", 1),
    ("fallback:currency", "The house sold for $118 000", "118000", 1),
    ("fallback:time", "They meet at 2:00 pm", "2", 1),
    ("fallback:equation", "Each day she makes 9 * 2 = $18 at the market.", "18", 1),
    ("fallback:rounding", "That is 15 / 90 * 100% = 16.66%, which rounds up to 17%.", "17", 1),
    ("fallback:comparison", "He pays $50 with the cheaper bag because 50 < 52", "50", 1),
    ("fallback:per_unit", "She earns $90 / 3 hours = $30/hour", "30", 1),
    ("fallback:calculator", "He has 3 * 12 = <<3*12=36>>36 pencils left", "36", 1),
    ("fallback:none", "I am not sure how to go on from here", "4", 0),
    ("boxes:several", "The roots are $\\boxed{-1}$ and $\\boxed{-9}$.", "-1, -9", 1),
    ("boxes:several", "The roots are $\\boxed{-1}$ and $\\boxed{-9}$.", "-9", 0),
    ("boxes:several", "So $x = \\boxed{2}$ or $x = \\boxed{3}$", "3, 2", 1),
    ("boxes:last_wins", "First guess \\boxed{5}. Checking again, that was wrong; the result is \\boxed{6}", "6", 1),
    ("boxes:nested", "So $\\boxed{\\boxed{\\dfrac{3}{4}}}$", "\\frac34", 1),
    ("boxes:unclosed", "\\boxed{5} and then cut off \\boxed{\\frac{1}{2", "5", 1),
    ("boxes:think", "<think>maybe \\boxed{7}</think> the answer is \\boxed{8}", "8", 1),
    ("heading", "#### For \\(T = 3\\):\nthe count is 7, so the answer is 7.", "7", 1),
    ("heading", "#### Step 2: the sum\nWe add 3 and 4 to get 7", "2", 0),
    ("gsm8k", "She sells 9 eggs for $2 each.\n#### 18", "18", 1),
    ("gsm8k", "Total: 1,200 eggs\n#### 1,200", "1200", 1),
    ("gsm8k_fewshot", "She has 16 - 3 - 4 = 9 eggs.\nA: 9", "9", 1),
    ("marker:filler", "Since 3 > 2, she buys B.\nThe answer is therefore 3.", "3", 1),
    ("marker:units", "The answer is 34 hours.", "34", 1),
    ("marker:words", "The answer is twelve.", "12", 1),
    ("marker:minerva_wrong", "Final Answer: The final answer is $\\frac{4}{35}$. I hope it is correct.", "35", 0),
]
# From the real-data regression set (tests/data/grader_realdata.jsonl.gz, ProcessBench / ReasonEval ids in
# common/tasks/rewards.py): the rules its disagreements motivated, with a neighbour that must stay wrong.
EXTRA += [
    ("fallback:math_delimiters", "Therefore, the solution to the problem is \\(b = 5\\).", "5", 1),
    ("fallback:math_delimiters", "Therefore, the solution to the problem is \\(b = 5\\).", "4", 0),
    ("fallback:bold", "Thus, there are **19** integers from 1 to 100, inclusive, that have a digit 6.", "19", 1),
    ("fallback:bold", "Thus, there are **19** integers from 1 to 100, inclusive, that have a digit 6.", "6", 0),
    ("fallback:equals_in_subject", "The range of the function \\(f(x) = \\arctan x + \\frac{1}{2} \\arcsin x\\) is "
     "\\(\\left[-\\frac{\\pi}{2}, \\frac{\\pi}{2}\\right]\\).", "\\left[ -\\frac{\\pi}{2}, \\frac{\\pi}{2} \\right]", 1),
    ("fallback:equation_without_value", "There are 1164 times \\(h:m:s\\) on a 24-hour digital clock where the hour, "
     "minute, and second satisfy the equation \\(h + m = s\\).", "1164", 1),
    ("fallback:equation_without_value", "Then 100/5 = 5A/5 or 20 = A.", "20", 1),
    ("fallback:list", "Therefore, the values of \\(n\\) are \\(n = 5\\) and \\(n = 15\\).", "5, 15", 1),
    ("fallback:list", "Therefore, the values of \\(n\\) are \\(n = 5\\) and \\(n = 15\\).", "15", 0),
    ("fallback:list", "So \\(4 + 4 = 8\\) and \\(8 \\times 2 = 16\\)", "16", 1),
    ("fallback:denial", "If we let \\( x = 14 \\), then \\( y = 15 \\). So, \\( x = 14 \\) and \\( y = 15 \\) is not a "
     "solution.", "15", 0),
    ("fallback:modal", "37 * 11 gives you 407. Ms. Alice can grade 407 papers in 11 hours.", "407", 1),
    ("fallback:modal", "The exponent is 9. This means 2007 can divide evenly into \\( 2007! \\) up to 9 times.", "9", 1),
    ("marker:sentence", "The change is $7.\n\n**Answer:** Verna received $7.00 in change.", "7", 1),
    ("marker:sentence", "**Final Answer**: The probability that Emile's set contains exactly 3 aces, given that he "
     "picks 39 cards, is \\(1\\).", "1", 1),
    ("marker:sentence", "**Final Answer**: The probability that Emile's set contains exactly 3 aces, given that he "
     "picks 39 cards, is \\(1\\).", "3", 0),
    ("marker:prm800k", "So the speed is 12*pi inches per second.\n# Answer\n\n12*pi", "12\\pi", 1),
    ("marker:prm800k", "4 + 7 = 11, so they are consistent.\n# Answer\n\nHillary has 7 nickels.", "7", 1),
    ("marker:prm800k", "4 + 7 = 11, so they are consistent.\n# Answer\n\nHillary has 7 nickels.", "11", 0),
    ("marker:prm800k", "So it is $\\frac{\\cos x}{\\sin x} = \\cot x.$\n# Answer\n\n\\cot x", "\\cot x", 1),
    ("boxes:empty", "So the answer is 5. \\(\\boxed{}\\)", "5", 1),
    ("boxes:same_sentence", "The maximum possible number is \\(\\boxed{3}\\), and the minimum possible number is "
     "\\(\\boxed{1}\\).", "1,3", 1),
    ("boxes:same_sentence", "The maximum possible number is \\(\\boxed{3}\\), and the minimum possible number is "
     "\\(\\boxed{1}\\).", "1", 0),
    ("clean:matrix", "\\[\\boxed{\\begin{pmatrix} -\\frac{1}{3} \\\\ \\frac{2}{3} \\end{pmatrix}}\\]",
     "\\begin{pmatrix} -1/3 \\\\ 2/3 \\end{pmatrix}", 1),
    ("clean:matrix", "\\[\\boxed{\\begin{pmatrix} -\\frac{1}{3} \\\\ \\frac{2}{3} \\end{pmatrix}}\\]",
     "\\begin{pmatrix} 2/3 \\\\ -1/3 \\end{pmatrix}", 0),
    ("clean:text_and", "\\[ \\boxed{(27, 20, 13) \\text{ and } (18, 20, 22)} \\]", "(27,20,13), (18,20,22)", 1),
    ("clean:qualifier", "\\[ \\boxed{\\frac{\\pi}{6} + k\\pi \\text{ for } k \\in \\mathbb{Z}} \\]", "\\frac{\\pi}{6}+k\\pi", 1),
    ("clean:squared_unit", "the surface area of the prism is \\(\\boxed{166 \\, \\text{cm}^2}\\).", "166", 1),
    ("clean:plus_minus", "Thus, the possible values for \\(m\\) are \\(\\boxed{±1, ±7}\\).", "1,-1,7,-7", 1),
    ("clean:plus_minus", "Thus, the possible values for \\(m\\) are \\(\\boxed{±1, ±7}\\).", "1,7", 0),
    ("clean:lost_dollar", "Therefore, Annika has $15 left. The final answer is: \\boxed{\\15}", "15", 1),
    ("clean:function_head", "The final answer is: \\(\\boxed{f(y) = 1}\\).", "f(x)=1", 1),
    ("compare:percent_fraction", "is approximately: \\[ \\boxed{0.625} \\]", "62.5%", 1),
    ("compare:percent_fraction", "is approximately: \\[ \\boxed{0.625\\%} \\]", "62.5%", 0),
    ("compare:interval", "\\[ \\boxed{\\frac{1}{2} \\leq x \\leq 8}. \\]", "[\\frac{1}{2}, 8]", 1),
    ("compare:interval", "\\[ \\boxed{\\frac{1}{2} < x \\leq 8}. \\]", "[\\frac{1}{2}, 8]", 0),
    ("compare:interval", "Final answer: \\(k < -5\\).", "(-\\infty,-5)", 1),
    ("compare:words_case", "So the answer is east.\n# Answer\n\nEast", "\\text{east}", 1),
    ("compare:words_case", "So the answer is east.\n# Answer\n\nEast", "\\text{west}", 0),
]
for rule, completion, gold, ok in EXTRA:
    cases.append({"rule": rule, "completion": completion, "answer": gold, "correct": ok})
# Order: a bare list is a set unless the question asks for an order.
for prompt, pred, gold, ok in [
    ("Find the ordered triple (a, b, c).", "2, 3, 4", "2, 4, 3", 0),
    ("Find the ordered triple (a, b, c).", "2, 4, 3", "2, 4, 3", 1),
    ("Enter all the solutions, separated by commas.", "2, 3, 4", "2, 4, 3", 1),
    ("List them in increasing order.", "1, 5, 9", "1, 9, 5", 0),
    ("Find the ordered pair.", "(4, 3)", "(3, 4)", 0),
    ("Determine the values of $T(10), T(11)$ and $T(12)$.", "2, 3, 4", "2, 4, 3", 0),
    ("The list $3 n^{2}, m^{2}, 2(n+1)^{2}$ consists of three consecutive integers written in increasing order. "
     "Determine all possible values of $m$.", "\\pm 1, \\pm 7", "1,-1,7,-7", 1),
    ("In order to find the roots, factor the polynomial. What are the roots?", "3, 1", "1, 3", 1),
]:
    cases.append({"rule": "order", "prompt": prompt, "completion": f"So it is $\\boxed{{{pred}}}$.", "answer": gold,
                  "correct": ok})
with open("tests/data/grader_cases.jsonl", "w") as f:
    for case in cases:
        f.write(json.dumps(case, ensure_ascii=False) + "\n")
print(len(cases))
