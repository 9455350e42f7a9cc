"""The SQL environment's databases and question templates: three schemas filled from a seed.

``SCHEMAS[name] = (ddl, fill)``: ``fill(conn, rng)`` inserts synthetic rows drawn from ``rng``
(a ``random.Random``), so the same seed gives the same database on every machine. Names are
unique within a table, so a question can name a customer, course or passenger unambiguously.

``TEMPLATES``: each pairs a question with its gold query; ``{0}``, ``{1}`` are filled from one
row of ``params_sql`` (run on the same database): raw in the question, as SQL literals in the query.
"""

from __future__ import annotations

import datetime
import random
import sqlite3
from collections.abc import Callable
from typing import NamedTuple

FIRST_NAMES = ("Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam", "Maya",
               "Nico", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes", "Xena", "Yusuf", "Zoe")
LAST_NAMES = ("Adams", "Brown", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Hansen", "Ito", "Jensen", "Khan",
              "Lopez", "Moreau", "Nowak", "Okafor", "Patel", "Quist", "Rossi", "Silva", "Tanaka", "Ueda", "Varga",
              "Weber", "Xu", "Young", "Zhang", "O'Brien")
AIRPORTS = (("CDG", "Paris", "France"), ("LYS", "Lyon", "France"), ("BER", "Berlin", "Germany"),
            ("MUC", "Munich", "Germany"), ("MAD", "Madrid", "Spain"), ("BCN", "Barcelona", "Spain"),
            ("FCO", "Rome", "Italy"), ("MXP", "Milan", "Italy"), ("NRT", "Tokyo", "Japan"), ("KIX", "Osaka", "Japan"),
            ("YYZ", "Toronto", "Canada"), ("YVR", "Vancouver", "Canada"))


def unique_names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct "First Last" names (at most 702)."""
    pool = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES]
    return rng.sample(pool, count)


def random_date(rng: random.Random, first: datetime.date, last: datetime.date) -> str:
    return (first + datetime.timedelta(days=rng.randrange((last - first).days + 1))).isoformat()


# ----- shop -----
SHOP_DDL = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, city TEXT NOT NULL, country TEXT NOT NULL,
                        signup_year INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, category TEXT NOT NULL, price REAL NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     order_date TEXT NOT NULL, status TEXT NOT NULL);
CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(id), product_id INTEGER NOT NULL REFERENCES products(id),
                          quantity INTEGER NOT NULL, PRIMARY KEY (order_id, product_id));
"""
PRODUCT_NOUNS = {
    "books": ("Atlas", "Cookbook", "Novel", "Journal", "Guide"), "games": ("Puzzle", "Chess Set", "Card Game", "Dice Set"),
    "garden": ("Hose", "Rake", "Planter", "Shovel"), "kitchen": ("Kettle", "Blender", "Skillet", "Toaster"),
    "music": ("Guitar", "Ukulele", "Drum Pad", "Harmonica"), "sports": ("Racket", "Yoga Mat", "Football", "Helmet"),
    "toys": ("Robot", "Kite", "Teddy Bear", "Train Set"),
}
PRODUCT_ADJECTIVES = ("Classic", "Compact", "Deluxe", "Eco", "Golden", "Handy", "Mini", "Pro", "Rapid", "Smart")


def fill_shop(conn: sqlite3.Connection, rng: random.Random) -> None:
    places = [(city, country) for _, city, country in AIRPORTS[:10]]
    customers = [(i + 1, name, *rng.choice(places), rng.randint(2019, 2024))
                 for i, name in enumerate(unique_names(rng, 120))]
    products = []
    cents = rng.sample(range(499, 19_999), 42)  # distinct prices: "most expensive" never ties
    for category, nouns in PRODUCT_NOUNS.items():
        names = rng.sample([f"{adj} {noun}" for adj in PRODUCT_ADJECTIVES for noun in nouns], 6)
        first = len(products)
        products += [(first + k + 1, name, category, cents[first + k] / 100) for k, name in enumerate(names)]
    buyers = rng.sample([c[0] for c in customers], 100)  # the other 20 never ordered
    sold = rng.sample([p[0] for p in products], 36)  # the other 6 were never ordered
    statuses = ("delivered",) * 6 + ("shipped",) * 2 + ("pending", "cancelled")
    orders, items = [], []
    for order_id in range(1, 401):
        orders.append((order_id, rng.choice(buyers), random_date(rng, datetime.date(2021, 1, 1), datetime.date(2024, 12, 31)),
                       rng.choice(statuses)))
        items += [(order_id, product_id, rng.randint(1, 5)) for product_id in rng.sample(sold, rng.randint(1, 3))]
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?, ?, ?)", customers)
    conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?)", products)
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)", orders)
    conn.executemany("INSERT INTO order_items VALUES (?, ?, ?)", items)


# ----- school -----
SCHOOL_DDL = """
CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, building TEXT NOT NULL);
CREATE TABLE teachers (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, department_id INTEGER NOT NULL REFERENCES departments(id),
                       hire_year INTEGER NOT NULL);
CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, year INTEGER NOT NULL, gpa REAL NOT NULL);
CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT NOT NULL UNIQUE, department_id INTEGER NOT NULL REFERENCES departments(id),
                      teacher_id INTEGER NOT NULL REFERENCES teachers(id), credits INTEGER NOT NULL);
CREATE TABLE enrollments (student_id INTEGER NOT NULL REFERENCES students(id), course_id INTEGER NOT NULL REFERENCES courses(id),
                          term TEXT NOT NULL, grade INTEGER NOT NULL, PRIMARY KEY (student_id, course_id, term));
"""
COURSES = {
    "Mathematics": ("Calculus I", "Calculus II", "Linear Algebra", "Statistics", "Number Theory"),
    "Physics": ("Mechanics", "Electromagnetism", "Quantum Physics", "Optics", "Thermodynamics"),
    "Chemistry": ("General Chemistry", "Organic Chemistry", "Biochemistry", "Physical Chemistry", "Lab Methods"),
    "Biology": ("Cell Biology", "Genetics", "Ecology", "Microbiology", "Zoology"),
    "History": ("Ancient History", "Medieval Europe", "Modern History", "World Wars", "History of Science"),
    "Literature": ("Poetry", "The Novel", "Drama", "Creative Writing", "World Literature"),
}
BUILDINGS = ("North Hall", "South Hall", "Science Center", "Old Library")
TERMS = ("2023-fall", "2024-spring", "2024-fall")


def fill_school(conn: sqlite3.Connection, rng: random.Random) -> None:
    departments = [(i + 1, name, rng.choice(BUILDINGS)) for i, name in enumerate(COURSES)]
    names = unique_names(rng, 174)
    teachers = [(i + 1, names[i], i % len(departments) + 1, rng.randint(2000, 2023)) for i in range(24)]
    students = [(i + 1, names[24 + i], rng.randint(1, 4), round(rng.uniform(2.0, 4.0), 2)) for i in range(150)]
    courses = []
    for dept_id, titles in enumerate(COURSES.values(), start=1):
        staff = [t[0] for t in teachers if t[2] == dept_id]
        first_id = len(courses) + 1
        courses += [(first_id + k, title, dept_id, rng.choice(staff), rng.randint(2, 6)) for k, title in enumerate(titles)]
    taken = rng.sample([(s[0], c[0], term) for s in students for c in courses for term in TERMS], 700)
    enrollments = [(student, course, term, rng.randint(40, 100)) for student, course, term in sorted(taken)]
    conn.executemany("INSERT INTO departments VALUES (?, ?, ?)", departments)
    conn.executemany("INSERT INTO teachers VALUES (?, ?, ?, ?)", teachers)
    conn.executemany("INSERT INTO students VALUES (?, ?, ?, ?)", students)
    conn.executemany("INSERT INTO courses VALUES (?, ?, ?, ?, ?)", courses)
    conn.executemany("INSERT INTO enrollments VALUES (?, ?, ?, ?)", enrollments)


# ----- flights -----
FLIGHTS_DDL = """
CREATE TABLE airports (code TEXT PRIMARY KEY, city TEXT NOT NULL UNIQUE, country TEXT NOT NULL);
CREATE TABLE airlines (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, country TEXT NOT NULL);
CREATE TABLE flights (id INTEGER PRIMARY KEY, airline_id INTEGER NOT NULL REFERENCES airlines(id),
                      origin TEXT NOT NULL REFERENCES airports(code), destination TEXT NOT NULL REFERENCES airports(code),
                      departure_date TEXT NOT NULL, duration_min INTEGER NOT NULL, price REAL NOT NULL);
CREATE TABLE passengers (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, nationality TEXT NOT NULL, birth_year INTEGER NOT NULL);
CREATE TABLE bookings (id INTEGER PRIMARY KEY, passenger_id INTEGER NOT NULL REFERENCES passengers(id),
                       flight_id INTEGER NOT NULL REFERENCES flights(id), seat_class TEXT NOT NULL, price_paid REAL NOT NULL);
"""
AIRLINES = (("Aurora Air", "Canada"), ("Blue Heron", "France"), ("Condor Lines", "Germany"), ("Iberflyer", "Spain"),
            ("Sakura Wings", "Japan"), ("Tiber Airways", "Italy"))
SEAT_CLASSES = {"economy": 1.0, "business": 2.5, "first": 4.0}  # price multiplier over the flight's fare


def fill_flights(conn: sqlite3.Connection, rng: random.Random) -> None:
    airlines = [(i + 1, name, country) for i, (name, country) in enumerate(AIRLINES)]
    codes = [code for code, _, _ in AIRPORTS]
    flights = []
    for flight_id in range(1, 301):
        origin, destination = rng.sample(codes, 2)
        flights.append((flight_id, rng.randint(1, len(airlines)), origin, destination,
                        random_date(rng, datetime.date(2024, 1, 1), datetime.date(2024, 12, 31)),
                        rng.randint(60, 720), rng.randint(4_000, 90_000) / 100))
    countries = sorted({country for _, _, country in AIRPORTS})
    passengers = [(i + 1, name, rng.choice(countries), rng.randint(1950, 2005))
                  for i, name in enumerate(unique_names(rng, 150))]
    classes = ("economy",) * 7 + ("business",) * 2 + ("first",)
    bookings = []
    for booking_id in range(1, 601):
        flight = rng.choice(flights)
        seat = rng.choice(classes)
        bookings.append((booking_id, rng.randint(1, len(passengers)), flight[0], seat, round(flight[6] * SEAT_CLASSES[seat], 2)))
    conn.executemany("INSERT INTO airports VALUES (?, ?, ?)", AIRPORTS)
    conn.executemany("INSERT INTO airlines VALUES (?, ?, ?)", airlines)
    conn.executemany("INSERT INTO flights VALUES (?, ?, ?, ?, ?, ?, ?)", flights)
    conn.executemany("INSERT INTO passengers VALUES (?, ?, ?, ?)", passengers)
    conn.executemany("INSERT INTO bookings VALUES (?, ?, ?, ?, ?)", bookings)


SCHEMAS: dict[str, tuple[str, Callable[[sqlite3.Connection, random.Random], None]]] = {
    "shop": (SHOP_DDL, fill_shop),
    "school": (SCHOOL_DDL, fill_school),
    "flights": (FLIGHTS_DDL, fill_flights),
}


# ----- templates -----
class Template(NamedTuple):
    """A question pattern with its gold query; ``params_sql`` lists the parameter rows."""

    schema: str
    name: str
    question: str
    sql: str
    params_sql: str


def _values(*values: object) -> str:
    # A one-column parameter list of constants, e.g. thresholds.
    return " UNION ALL ".join(f"SELECT {v!r} AS v" for v in values) + " ORDER BY 1"


_CATEGORIES = "SELECT DISTINCT category FROM products ORDER BY 1"
_CITIES_SHOP = "SELECT DISTINCT city FROM customers ORDER BY 1"
_COUNTRIES_SHOP = "SELECT DISTINCT country FROM customers ORDER BY 1"
_YEARS = "SELECT DISTINCT substr(order_date, 1, 4) FROM orders ORDER BY 1"
_BUYERS = "SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id ORDER BY 1"
_DEPARTMENTS = "SELECT name FROM departments ORDER BY 1"
_COURSE_TERMS = ("SELECT DISTINCT c.title, e.term FROM courses c JOIN enrollments e ON e.course_id = c.id ORDER BY 1, 2")
_DEPT_TERMS = "SELECT d.name, t.term FROM departments d, (SELECT DISTINCT term FROM enrollments) t ORDER BY 1, 2"
_CITIES_AIR = "SELECT city FROM airports ORDER BY 1"
_ROUTES = ("SELECT DISTINCT a.city, b.city FROM flights f JOIN airports a ON a.code = f.origin "
           "JOIN airports b ON b.code = f.destination ORDER BY 1, 2")
_AIRLINES = "SELECT name FROM airlines ORDER BY 1"
_ROUTE_JOIN = "FROM flights AS f JOIN airports AS a ON a.code = f.origin JOIN airports AS b ON b.code = f.destination"
_SPENT = ("FROM customers AS c JOIN orders AS o ON o.customer_id = c.id JOIN order_items AS oi ON oi.order_id = o.id "
          "JOIN products AS p ON p.id = oi.product_id")

TEMPLATES: tuple[Template, ...] = tuple(Template(*t) for t in (
    # shop
    ("shop", "count_city", "How many customers live in {0}?", "SELECT COUNT(*) FROM customers WHERE city = {0}", _CITIES_SHOP),
    ("shop", "customers_country", "List the names of all customers from {0}.",
     "SELECT name FROM customers WHERE country = {0}", _COUNTRIES_SHOP),
    ("shop", "products_by_price", "List the names of the products in the '{0}' category, from cheapest to most expensive.",
     "SELECT name FROM products WHERE category = {0} ORDER BY price", _CATEGORIES),
    ("shop", "avg_price_category", "What is the average price of the products in the '{0}' category, rounded to 2 decimal places?",
     "SELECT ROUND(AVG(price), 2) FROM products WHERE category = {0}", _CATEGORIES),
    ("shop", "count_status_year", "How many orders placed in {1} have the status '{0}'?",
     "SELECT COUNT(*) FROM orders WHERE status = {0} AND substr(order_date, 1, 4) = {1}",
     "SELECT DISTINCT status, substr(order_date, 1, 4) FROM orders ORDER BY 1, 2"),
    ("shop", "units_product", "How many units of '{0}' were ordered in total, over all orders?",
     "SELECT SUM(oi.quantity) FROM order_items AS oi JOIN products AS p ON p.id = oi.product_id WHERE p.name = {0}",
     "SELECT DISTINCT p.name FROM products p JOIN order_items oi ON oi.product_id = p.id ORDER BY 1"),
    ("shop", "buyers_city", "List the names of the customers from {0} who have placed at least one order.",
     "SELECT DISTINCT c.name FROM customers AS c JOIN orders AS o ON o.customer_id = c.id WHERE c.city = {0}", _CITIES_SHOP),
    ("shop", "top_products_category",
     "List the names and prices of the {1} most expensive products in the '{0}' category, most expensive first.",
     "SELECT name, price FROM products WHERE category = {0} ORDER BY price DESC LIMIT {1}",
     f"SELECT category, v FROM ({_CATEGORIES}), ({_values(2, 3)}) ORDER BY 1, 2"),
    ("shop", "orders_of_customer", "How many orders has {0} placed?",
     "SELECT COUNT(*) FROM orders AS o JOIN customers AS c ON c.id = o.customer_id WHERE c.name = {0}",
     "SELECT name FROM customers ORDER BY 1"),
    ("shop", "spent_by_customer", "How much has {0} spent in total on orders that were not cancelled "
     "(the sum of price times quantity), rounded to 2 decimal places?",
     f"SELECT ROUND(SUM(p.price * oi.quantity), 2) {_SPENT} WHERE c.name = {{0}} AND o.status <> 'cancelled'",
     "SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id WHERE o.status <> 'cancelled' ORDER BY 1"),
    ("shop", "categories_above", "Which product categories have an average product price above {0}? List the category names.",
     "SELECT category FROM products GROUP BY category HAVING AVG(price) > {0}", _values(60, 80, 100, 120)),
    ("shop", "never_ordered_country", "List the names of the customers from {0} who have never placed an order.",
     "SELECT name FROM customers WHERE country = {0} AND id NOT IN (SELECT customer_id FROM orders)", _COUNTRIES_SHOP),
    ("shop", "most_orders_year", "Which customer placed the most orders in {0}? Give the name.",
     "SELECT c.name FROM customers AS c JOIN orders AS o ON o.customer_id = c.id WHERE substr(o.order_date, 1, 4) = {0} "
     "GROUP BY c.id ORDER BY COUNT(*) DESC LIMIT 1", _YEARS),
    ("shop", "status_counts_year", "For each order status, how many orders placed in {0} have it? "
     "Return the status and the number of orders.",
     "SELECT status, COUNT(*) FROM orders WHERE substr(order_date, 1, 4) = {0} GROUP BY status", _YEARS),
    ("shop", "distinct_products_customer", "How many different products has {0} ordered?",
     f"SELECT COUNT(DISTINCT oi.product_id) {_SPENT} WHERE c.name = {{0}}", _BUYERS),
    ("shop", "unsold_category", "List the names of the products in the '{0}' category that have never been ordered.",
     "SELECT name FROM products WHERE category = {0} AND id NOT IN (SELECT product_id FROM order_items)", _CATEGORIES),
    ("shop", "orders_between", "How many orders were placed from {0} to {1}, both days included?",
     "SELECT COUNT(*) FROM orders WHERE order_date BETWEEN {0} AND {1}",
     "SELECT d, date(d, '+45 days') FROM (SELECT DISTINCT substr(order_date, 1, 7) || '-01' AS d FROM orders) ORDER BY 1"),
    # school
    ("school", "count_year", "How many students are in year {0}?", "SELECT COUNT(*) FROM students WHERE year = {0}",
     "SELECT DISTINCT year FROM students ORDER BY 1"),
    ("school", "teachers_dept", "List the names of the teachers in the {0} department.",
     "SELECT t.name FROM teachers AS t JOIN departments AS d ON d.id = t.department_id WHERE d.name = {0}", _DEPARTMENTS),
    ("school", "avg_gpa_year", "What is the average GPA of the year {0} students, rounded to 2 decimal places?",
     "SELECT ROUND(AVG(gpa), 2) FROM students WHERE year = {0}", "SELECT DISTINCT year FROM students ORDER BY 1"),
    ("school", "courses_teacher", "List the titles of the courses taught by {0}.",
     "SELECT c.title FROM courses AS c JOIN teachers AS t ON t.id = c.teacher_id WHERE t.name = {0}",
     "SELECT DISTINCT t.name FROM teachers t JOIN courses c ON c.teacher_id = t.id ORDER BY 1"),
    ("school", "enrolled_course_term", "How many students are enrolled in '{0}' in the {1} term?",
     "SELECT COUNT(*) FROM enrollments AS e JOIN courses AS c ON c.id = e.course_id WHERE c.title = {0} AND e.term = {1}",
     _COURSE_TERMS),
    ("school", "max_grade_course", "What is the highest grade obtained in '{0}', over all terms?",
     "SELECT MAX(e.grade) FROM enrollments AS e JOIN courses AS c ON c.id = e.course_id WHERE c.title = {0}",
     "SELECT DISTINCT c.title FROM courses c JOIN enrollments e ON e.course_id = c.id ORDER BY 1"),
    ("school", "students_course_sorted",
     "List, in alphabetical order, the names of the students who took '{0}' in the {1} term.",
     "SELECT s.name FROM students AS s JOIN enrollments AS e ON e.student_id = s.id JOIN courses AS c ON c.id = e.course_id "
     "WHERE c.title = {0} AND e.term = {1} ORDER BY s.name", _COURSE_TERMS),
    ("school", "credits_dept", "How many credits do the courses of the {0} department add up to?",
     "SELECT SUM(c.credits) FROM courses AS c JOIN departments AS d ON d.id = c.department_id WHERE d.name = {0}", _DEPARTMENTS),
    ("school", "dept_most_hires", "Which department has the most teachers hired after {0} (hire year greater than {0})? "
     "Give its name.",
     "SELECT d.name FROM departments AS d JOIN teachers AS t ON t.department_id = d.id WHERE t.hire_year > {0} "
     "GROUP BY d.id ORDER BY COUNT(*) DESC LIMIT 1", _values(2005, 2010, 2015, 2018)),
    ("school", "high_gpa", "List the names and GPAs of the students with a GPA of at least {0}, "
     "highest GPA first and equal GPAs by name.",
     "SELECT name, gpa FROM students WHERE gpa >= {0} ORDER BY gpa DESC, name", _values(3.7, 3.8, 3.9)),
    ("school", "avg_grade_dept_term", "What is the average grade in the {0} department's courses in the {1} term, "
     "rounded to 1 decimal place?",
     "SELECT ROUND(AVG(e.grade), 1) FROM enrollments AS e JOIN courses AS c ON c.id = e.course_id "
     "JOIN departments AS d ON d.id = c.department_id WHERE d.name = {0} AND e.term = {1}", _DEPT_TERMS),
    ("school", "courses_of_student", "How many different courses has {0} enrolled in?",
     "SELECT COUNT(DISTINCT e.course_id) FROM enrollments AS e JOIN students AS s ON s.id = e.student_id WHERE s.name = {0}",
     "SELECT name FROM students ORDER BY 1"),
    ("school", "building_course", "In which building is the course '{0}' taught (its department's building)?",
     "SELECT d.building FROM courses AS c JOIN departments AS d ON d.id = c.department_id WHERE c.title = {0}",
     "SELECT title FROM courses ORDER BY 1"),
    ("school", "busy_teachers", "List the names of the teachers who teach more than {0} courses.",
     "SELECT t.name FROM teachers AS t JOIN courses AS c ON c.teacher_id = t.id GROUP BY t.id HAVING COUNT(*) > {0}",
     _values(0, 1, 2)),
    # flights
    ("flights", "departures_city", "How many flights depart from {0}?",
     "SELECT COUNT(*) FROM flights AS f JOIN airports AS a ON a.code = f.origin WHERE a.city = {0}", _CITIES_AIR),
    ("flights", "airports_country", "List the codes of the airports in {0}.", "SELECT code FROM airports WHERE country = {0}",
     "SELECT DISTINCT country FROM airports ORDER BY 1"),
    ("flights", "cheapest_route", "What is the lowest price of a flight from {0} to {1}?",
     f"SELECT MIN(f.price) {_ROUTE_JOIN} WHERE a.city = {{0}} AND b.city = {{1}}", _ROUTES),
    ("flights", "flights_airline", "How many flights does {0} operate?",
     "SELECT COUNT(*) FROM flights AS f JOIN airlines AS l ON l.id = f.airline_id WHERE l.name = {0}", _AIRLINES),
    ("flights", "avg_duration_airline", "What is the average duration of {0} flights in minutes, "
     "rounded to the nearest whole minute?",
     "SELECT ROUND(AVG(f.duration_min)) FROM flights AS f JOIN airlines AS l ON l.id = f.airline_id WHERE l.name = {0}",
     _AIRLINES),
    ("flights", "class_passengers_month", "List the names of the passengers who booked a {0} seat on a flight departing "
     "in the month {1} (YYYY-MM).",
     "SELECT DISTINCT p.name FROM passengers AS p JOIN bookings AS b ON b.passenger_id = p.id JOIN flights AS f "
     "ON f.id = b.flight_id WHERE b.seat_class = {0} AND substr(f.departure_date, 1, 7) = {1}",
     "SELECT DISTINCT b.seat_class, substr(f.departure_date, 1, 7) FROM bookings b JOIN flights f ON f.id = b.flight_id "
     "WHERE b.seat_class <> 'economy' ORDER BY 1, 2"),
    ("flights", "bookings_passenger", "How many bookings has {0} made?",
     "SELECT COUNT(*) FROM bookings AS b JOIN passengers AS p ON p.id = b.passenger_id WHERE p.name = {0}",
     "SELECT name FROM passengers ORDER BY 1"),
    ("flights", "top_destination", "Of the flights from {0}, which destination city do the most of them fly to?",
     f"SELECT b.city {_ROUTE_JOIN} WHERE a.city = {{0}} GROUP BY b.city ORDER BY COUNT(*) DESC LIMIT 1", _CITIES_AIR),
    ("flights", "route_flights", "List the ids and departure dates of the flights from {0} to {1}, earliest first "
     "(equal dates by id).",
     f"SELECT f.id, f.departure_date {_ROUTE_JOIN} WHERE a.city = {{0}} AND b.city = {{1}} ORDER BY f.departure_date, f.id",
     _ROUTES),
    ("flights", "passengers_born_before", "How many passengers of nationality '{0}' were born before {1}?",
     "SELECT COUNT(*) FROM passengers WHERE nationality = {0} AND birth_year < {1}",
     f"SELECT n, v FROM (SELECT DISTINCT nationality AS n FROM passengers), ({_values(1970, 1980, 1990)}) ORDER BY 1, 2"),
    ("flights", "revenue_class_airline", "What is the total amount paid for {0} bookings on {1} flights, "
     "rounded to 2 decimal places?",
     "SELECT ROUND(SUM(b.price_paid), 2) FROM bookings AS b JOIN flights AS f ON f.id = b.flight_id "
     "JOIN airlines AS l ON l.id = f.airline_id WHERE b.seat_class = {0} AND l.name = {1}",
     "SELECT DISTINCT b.seat_class, l.name FROM bookings b JOIN flights f ON f.id = b.flight_id "
     "JOIN airlines l ON l.id = f.airline_id ORDER BY 1, 2"),
    ("flights", "airlines_from_city", "Which airlines have flights departing from {0}? List their names.",
     "SELECT DISTINCT l.name FROM airlines AS l JOIN flights AS f ON f.airline_id = l.id JOIN airports AS a "
     "ON a.code = f.origin WHERE a.city = {0}", _CITIES_AIR),
    ("flights", "passengers_airline_month", "List, in alphabetical order, the names of the passengers booked on {0} "
     "flights departing in the month {1} (YYYY-MM).",
     "SELECT DISTINCT p.name FROM passengers AS p JOIN bookings AS b ON b.passenger_id = p.id JOIN flights AS f "
     "ON f.id = b.flight_id JOIN airlines AS l ON l.id = f.airline_id WHERE l.name = {0} "
     "AND substr(f.departure_date, 1, 7) = {1} ORDER BY p.name",
     "SELECT DISTINCT l.name, substr(f.departure_date, 1, 7) FROM flights f JOIN airlines l ON l.id = f.airline_id "
     "JOIN bookings b ON b.flight_id = f.id ORDER BY 1, 2"),
    ("flights", "long_flights", "How many flights last longer than {0} minutes?",
     "SELECT COUNT(*) FROM flights WHERE duration_min > {0}", _values(90, 120, 180, 240, 300, 360, 480, 600)),
    ("flights", "domestic", "How many flights stay within {0} (both airports in {0})?",
     f"SELECT COUNT(*) {_ROUTE_JOIN} WHERE a.country = {{0}} AND b.country = {{0}}",
     "SELECT DISTINCT country FROM airports ORDER BY 1"),
))
