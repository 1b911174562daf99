"""Clean answers the degenerate-output signal must not flag, beyond the simulator's.

The simulator's clean answers are English prose, code and Chinese/Japanese text. Real
assistants also answer in other scripts, draw tables, trees and sparklines, and write
code with repetitive lines. These hand-written samples and generated markdown tables
cover that (used by ``bench/quality.py`` and ``tests/test_degenerate.py``).
"""

from __future__ import annotations

import random

MULTILINGUAL: dict[str, str] = {
    "ru": (
        "Конечно! Вот краткое объяснение. Кэш префиксов позволяет повторно использовать "
        "уже вычисленные ключи и значения внимания, если несколько запросов начинаются с "
        "одинакового текста. Это ускоряет ответ, но требует аккуратной изоляции между "
        "клиентами. Ёлка, щёки, подъезд — обычные слова с буквами ё, щ и ъ."
    ),
    "uk": (
        "Ґанок, їжак, європейський — українська мова має літери ґ, ї, є та і. "
        "Налаштуйте сервер так, щоб кожен орендар мав власну сіль кешу."
    ),
    "el": (
        "Η προσωρινή μνήμη προθεμάτων επιτρέπει την επαναχρησιμοποίηση υπολογισμών. "
        "Για την απομόνωση των πελατών, ορίστε διαφορετικό αλάτι ανά μισθωτή. Ευχαριστώ!"
    ),
    "ar": (
        "بالتأكيد! ذاكرة التخزين المؤقت للبادئة تعيد استخدام الحسابات السابقة عندما تبدأ "
        "عدة طلبات بنفس النص. يجب عزل المستأجرين عن بعضهم البعض لتجنب تسرب البيانات."
    ),
    "he": "בהחלט! מטמון הקידומות משתמש מחדש בחישובים קודמים. יש לבודד בין הלקוחות השונים.",
    "hi": (
        "ज़रूर! प्रीफ़िक्स कैश पहले से गणना किए गए मानों का फिर से उपयोग करता है। "
        "अलग-अलग ग्राहकों के बीच डेटा को अलग रखना ज़रूरी है।"
    ),
    "ko": (
        "물론입니다! 접두사 캐시는 같은 텍스트로 시작하는 요청들의 계산 결과를 재사용합니다. "
        "테넌트마다 다른 캐시 솔트를 설정하면 격리할 수 있습니다."
    ),
    "th": "แน่นอน! แคชคำนำหน้าช่วยให้ระบบนำผลการคำนวณเดิมกลับมาใช้ใหม่ได้ ควรแยกข้อมูลของลูกค้าแต่ละราย",
    "vi": (
        "Chắc chắn rồi! Bộ nhớ đệm tiền tố cho phép tái sử dụng các phép tính trước đó. "
        "Hãy đặt muối bộ nhớ đệm riêng cho từng khách thuê để cách ly dữ liệu."
    ),
    "de": (
        "Gerne! Der Präfix-Cache verwendet bereits berechnete Schlüssel und Werte erneut. "
        "Größere Mandanten sollten getrennte Salze bekommen — das schützt vor Übersprechen."
    ),
    "tr": "Elbette! İstanbul'daki sunucularda önbellek tuzu her kiracı için ayrı ayarlanmalı.",
    "ja-mixed": (
        "はい、もちろんです。KVキャッシュ（key-value cache）は、同じプレフィックスを持つ"
        "リクエスト間で再利用されます。テナントごとに cache_salt を設定してください。"
    ),
    "zh-mixed": (
        "当然可以！前缀缓存会复用相同开头的请求的计算结果。请为每个租户设置不同的 "
        "cache_salt，例如使用 HMAC-SHA256 生成。注音符号如ㄅㄆㄇ偶尔也会出现。"
    ),
    "emoji": (
        "Great question! 🎉 Here's the plan:\n✅ set the salt\n✅ add the canary\n"
        "❌ don't log prompts\n👉 check the metrics 📈 and the alerts 🚨. 👍🏽 Done! 🇩🇪🇫🇷"
    ),
    "math": (
        "Let f: ℝ → ℝ be continuous. Then ∫₀¹ f(x) dx = lim_{n→∞} (1/n) ∑ f(k/n), and "
        "for all ε > 0 there is δ > 0 with |x − y| < δ ⇒ |f(x) − f(y)| < ε. Over ℤ, ℚ and ℂ "
        "the identity α² + β² ≥ 2αβ holds; ∮ and ∯ denote closed integrals. ∎"
    ),
    "tree": (
        "Project layout:\n\n```\nproxy/\n├── addon.py\n├── engine/\n│   ├── detector.py\n"
        "│   └── index.py\n└── sim/\n    ├── server.py\n    └── faults.py\n```"
    ),
    "sparkline": "Latency over the week: ▁▂▃▅▇█▇▅▃▂▁ (peak on Thursday). Load: ▓▓▓▓▓▓░░░░ 60%.",
    "code-zeros": (
        "```python\nmatrix = [\n    [0, 0, 0, 0, 0, 0, 0, 0],\n    [0, 1, 0, 0, 0, 0, 0, 0],\n"
        "    [0, 0, 1, 0, 0, 0, 0, 0],\n]\nbuf = bytearray(16)\n```"
    ),
    "code-repetitive": (
        "```c\nswitch (op) {\n    case ADD: return a + b;\n    case SUB: return a - b;\n"
        "    case MUL: return a * b;\n    case DIV: return a / b;\n    default: break;\n}\n"
        "        }\n    }\n}\n```"
    ),
    "tokenizer-doc": (
        "GPT-2 marks the end of a document with <|endoftext|>; unknown words become a "
        "special token in older vocabularies. SentencePiece writes a word boundary as ▁."
    ),
    "checklist-table": (
        "| Feature | crosstalk | LiteLLM | Presidio |\n|:---|:---:|:---:|:---:|\n"
        "| streaming scan | ✓ | ✓ | ✗ |\n| cross-tenant | ✓ | ✗ | ✗ |\n"
        "| canaries | ✓ | ✗ | ✗ |\n| metrics | ✓ | ✓ | ✗ |"
    ),
}


def markdown_table(rng: random.Random) -> str:
    """A markdown table of 3-12 columns and 2-20 rows: words, numbers, ticks, blanks."""
    cols = rng.randint(3, 12)
    header = ["Name", *(f"Q{i}" for i in range(1, cols))]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(rng.choice(("---", ":---:", " --- ", "---:")) for _ in header) + "|",
    ]
    for r in range(rng.randint(2, 20)):
        cells = [f"row {r + 1}"]
        for _ in range(cols - 1):
            cells.append(
                rng.choice(
                    (
                        str(rng.randint(0, 999)),
                        f"{rng.random() * 100:.1f}%",
                        "✓",
                        "",
                        "n/a",
                        rng.choice(("yes", "no", "high", "low")),
                    )
                )
            )
        lines.append("| " + " | ".join(cells) + " |")
    return rng.choice(("Here is the table:\n\n", "", "Summary:\n")) + "\n".join(lines)
